"""The deciding side's view of its ranks: their acknowledgements in, dead or stalled ranks out.

A deciding block manager has one mirror per rank (a tensor-parallel worker or
a pipeline stage, each mapping the same page ids on its own device, charged on
that device's budget). :class:`RankMirrors` reads every rank's acknowledgement
from the :class:`~kvcached.integration.common.acks.AckBoard` and hands it to
the manager, which then releases that rank's unmapped pages on that rank's
budget. A rank whose process is gone, or whose oldest unacknowledged batch is
older than a bound, is declared lost (``mirror_lost``): what it held goes back
to its device budget and the other ranks stop waiting for it. That is logged
as an error: the rank's device may still hold its pages if it was only slow.
A rank whose word cannot be a true acknowledgement (a batch never handed out,
or lower than what it acknowledged before: a corrupt or hostile word) is
declared lost the same way; one bad word never stops the deciding process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Callable, Optional

from kvcached.errors import InvalidArgumentError
from kvcached.integration.common.acks import AckBoard
from kvcached.integration.common.rank_devices import RankDevice

_logger = logging.getLogger(__name__)
#: Seconds between two checks for dead or stalled ranks (acknowledgements are read every poll).
CHECK_INTERVAL_S = 1.0


def process_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie, dead but not reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


class RankMirrors:
    """Acknowledgements from every rank to a deciding manager, and dead-rank handling.

    Args:
        manager: a device-less ``BlockManager`` with one mirror per rank, in rank order.
        board: where the ranks publish what they applied.
        ranks: each rank's device and process.
        ack_timeout_s: a rank with a batch unacknowledged for longer is declared lost.
        is_alive: how a rank's process is checked (a test may replace it).
    """

    def __init__(
        self,
        manager: Any,
        board: AckBoard,
        ranks: Sequence[RankDevice],
        *,
        ack_timeout_s: float,
        logger: Optional[logging.Logger] = None,
        is_alive: Callable[[int], bool] = process_alive,
    ) -> None:
        if manager.num_mirrors != len(ranks) or board.num_ranks != len(ranks):
            raise InvalidArgumentError(
                f"{len(ranks)} ranks, {manager.num_mirrors} mirrors, {board.num_ranks} board slots"
            )
        self.manager = manager
        self.board = board
        self.ranks = list(ranks)
        self.ack_timeout_s = ack_timeout_s
        self.lost: dict[int, str] = {}  # rank -> why it was declared lost
        self._logger = logger or _logger
        self._is_alive = is_alive
        self._seen = [0] * len(ranks)
        self._next_check = 0.0

    def poll(self) -> None:
        """Acknowledges what every rank applied since the last poll; checks the ranks now and then."""
        seqs = self.board.seqs()
        if seqs != self._seen:
            for rank, (seq, seen) in enumerate(zip(seqs, self._seen)):
                if seq != seen and rank not in self.lost:
                    self._take_acknowledgement(rank, seq, seen)
            self._seen = seqs
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + CHECK_INTERVAL_S
            self.check_ranks()

    def _take_acknowledgement(self, rank: int, seq: int, seen: int) -> None:
        """Hands ``rank``'s new word to the manager, or declares the rank lost when the word is impossible."""
        if seq < seen:
            self.declare_lost(rank, f"its acknowledgement went back from {seen} to {seq} (a corrupt board word)")
            return
        try:
            self.manager.acknowledge(rank, seq)
        except ValueError as exc:  # the manager's own check: a batch it never handed out
            self.declare_lost(rank, f"{exc} (a corrupt board word)")

    def check_ranks(self) -> list[int]:
        """Declares lost every rank whose process is gone or that stopped acknowledging; returns them."""
        found = []
        for rank, progress in enumerate(self.manager.stats()["mirrors"]):
            if not progress["alive"] or rank in self.lost:
                continue
            pid = self.ranks[rank].pid
            if not self._is_alive(pid):
                why = f"its process {pid} is gone"
            elif progress["unacked_batches"] and progress["oldest_unacked_age_s"] > self.ack_timeout_s:
                why = (
                    f"it acknowledged no page operations for {progress['oldest_unacked_age_s']:.0f} s "
                    f"(KVCACHED_RANK_ACK_TIMEOUT_S={self.ack_timeout_s:g})"
                )
            else:
                continue
            self.declare_lost(rank, why)
            found.append(rank)
        return found

    def declare_lost(self, rank: int, why: str) -> None:
        """Gives back what ``rank`` holds on its device budget and stops waiting for it."""
        held = self.manager.stats()["mirrors"][rank]["held_bytes"]
        self.manager.mirror_lost(rank)
        self.lost[rank] = why
        device = self.ranks[rank]
        self._logger.error(
            "kvcached: rank %d (%s on %s) is lost: %s; its %d bytes go back to the device budget and "
            "the other ranks no longer wait for it",
            rank,
            device.local_device,
            device.device,
            why,
            held,
        )

    def close(self) -> None:
        self.board.close()


__all__ = ["CHECK_INTERVAL_S", "RankMirrors", "process_alive"]
