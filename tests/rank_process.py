"""A rank's process for the integration tests: a WorkerSpace that applies page ops sent over a pipe.

Started with the ``spawn`` method (a fresh interpreter, as engines start
their workers); the test drives it with :class:`RankProcess`.
"""

from __future__ import annotations

import multiprocessing
import pickle
from typing import Any


def _serve(conn: Any, layout_bytes: bytes, rank: int, board_path: str, num_ranks: int) -> None:
    from kvcached.integration.common.acks import AckBoard
    from kvcached.integration.common.devices import describe_rank
    from kvcached.integration.common.space import WorkerSpace

    layout = pickle.loads(layout_bytes)
    space = WorkerSpace(layout, device="cpu", rank=rank, board=AckBoard.attach(board_path, num_ranks))
    conn.send(describe_rank("cpu", rank))
    while True:
        message = conn.recv()
        if message is None:
            break
        if message == "stall":
            continue  # receives batches no more: it stops acknowledging
        if message == "stats":
            conn.send(space.stats())
            continue
        space.apply(message)
        conn.send(space.stats())
    space.close()
    conn.send("closed")


class RankProcess:
    """Rank ``rank`` in a process of its own, mapping ``layout`` on the host."""

    def __init__(self, layout: Any, rank: int, board_path: str, num_ranks: int) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_serve, args=(child, pickle.dumps(layout), rank, board_path, num_ranks),
                                       daemon=True)
        self.process.start()
        self.device = self.conn.recv()  # its RankDevice, described in its own process

    def apply(self, ops: Any) -> dict:
        self.conn.send(ops)
        return self.conn.recv()

    def stats(self) -> dict:
        self.conn.send("stats")
        return self.conn.recv()

    def stall(self) -> None:
        self.conn.send("stall")

    def kill(self) -> None:
        self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        if self.process.is_alive():
            self.conn.send(None)
            self.conn.recv()
        self.process.join(10)
