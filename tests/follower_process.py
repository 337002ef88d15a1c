"""A follower rank in a process of its own, for the agreed-blocks tests: replays the leader's answers.

Started with ``spawn``; the test sends it the leader's setup, then calls (method name and
arguments) that it makes on its :class:`FollowerBlocks`, returning each result or error.
"""

from __future__ import annotations

import multiprocessing
import pickle
from typing import Any


def _serve(conn: Any, layouts_bytes: bytes, rank: int) -> None:
    from kvcached.integration.common.agreed_blocks import FollowerBlocks
    from kvcached.integration.common.rank_devices import describe_rank

    layouts = pickle.loads(layouts_bytes)
    device = describe_rank("cpu", rank)
    conn.send(device)
    blocks = FollowerBlocks.open(conn.recv(), layouts, device)
    conn.send("attached")
    while True:
        call = conn.recv()
        if call is None:
            break
        method, args = call
        try:
            if method == "own_mapped_pages":
                result = blocks.own.stats()["mapped_pages"]
            elif method == "logical_free":
                result = blocks.logical_free()
            else:
                result = getattr(blocks, method)(*args)
                if method == "alloc":
                    result = sorted(int(i) for i in result)
            conn.send(("ok", result))
        except Exception as exc:  # the test checks the error
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    blocks.close()
    conn.send("closed")


class FollowerProcess:
    """Follower rank ``rank`` of an engine whose layouts are ``layouts``."""

    def __init__(self, layouts: list, rank: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, pickle.dumps(layouts), rank), daemon=True)
        self.process.start()
        self.device = self.conn.recv()

    def attach(self, setup: dict) -> None:
        self.conn.send(setup)
        assert self.conn.recv() == "attached"

    def call(self, method: str, *args: Any) -> tuple[str, Any]:
        self.conn.send((method, args))
        return self.conn.recv()

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
            self.conn.recv()
            self.process.join(10)
