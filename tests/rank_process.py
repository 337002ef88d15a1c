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
    from kvcached.integration.common.rank_devices import describe_rank
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
        self.process = context.Process(
            target=_serve, args=(child, pickle.dumps(layout), rank, board_path, num_ranks), daemon=True
        )
        self.process.start()
        self._device: Any = None

    @property
    def device(self) -> Any:
        """Its RankDevice, described in its own process (waits for the process to be ready)."""
        if self._device is None:
            self._device = self.conn.recv()
        return self._device

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
        """Closes its space and ends the process (see :func:`close_all` for several at once)."""
        close_all([self])


def close_all(ranks: list[RankProcess]) -> None:
    """Ends these rank processes, all at once."""
    asked = []
    for rank in ranks:
        if rank.process.is_alive():
            rank.device  # noqa: B018 - its first message must be read before the next
            rank.conn.send(None)
            asked.append(rank)
    for rank in asked:
        rank.conn.recv()
    for rank in ranks:
        rank.process.join(10)
