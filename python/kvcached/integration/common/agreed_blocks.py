"""Block decisions taken once for ranks that each run their own scheduler (SGLang's tensor and pipeline ranks).

Rationale
---------
SGLang runs one scheduler per rank and relies on every one of them taking the
same decisions from the same inputs. If each rank asked its own device's
budget, one could be refused where another is not, and the ranks would
diverge and hang. So one rank, the leader, decides for all of them with the
machinery the vLLM path uses: a device-less block manager with one
:class:`kvcached.layout.Mirror` per rank (every page charged on every rank's
device budget, all or nothing, released on a rank's budget once that rank
acknowledged the unmap; :class:`~kvcached.integration.common.blocks.EngineBlocks`),
acknowledgements on an :class:`~kvcached.integration.common.acks.AckBoard`, and
:class:`~kvcached.integration.common.mirrors.RankMirrors` declaring dead or
stalled ranks lost. The other ranks, followers, ask the same questions in the
same order (their schedulers run the same code on the same inputs) and replay
the leader's answers, which carry the page operations each rank applies to
its own KV space (:class:`~kvcached.integration.common.space.WorkerSpace`).

Approach
--------
Every call whose answer depends on memory or time (``alloc``, ``secure``,
``available``, ``end_step``, ``trim``, ``clear``, ``sleep``, ``wake_up``,
:meth:`agree`) is one message
from the leader (:mod:`.decision_channel`) holding the answer, the blocks then
secured and the page operations taken since the last message; a follower
checks that the message answers the question it asked, applies the page
operations, and returns the same answer. What follows from the answers alone
(blocks handed out, blocks secured) is counted alike on every rank without a
message, so rank-dependent callers (logging, metrics) may read it freely.

Limitations
-----------
One machine (pipes and acknowledgements through ``/proc``), as for the vLLM path.
A follower whose scheduler took a different path fails with an error naming both
questions rather than diverging silently.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import numpy as np

from kvcached.errors import IntegrationError, OutOfMemoryError
from kvcached.integration.common.acks import AckBoard
from kvcached.integration.common.blocks import EngineBlocks
from kvcached.integration.common.decision_channel import DecisionReceiver, DecisionSender
from kvcached.integration.common.rank_devices import RankDevice
from kvcached.integration.common.registration import register_ranks
from kvcached.integration.common.space import WorkerSpace
from kvcached.layout import KVLayout
from kvcached.registry import MemoryPolicy

_logger = logging.getLogger(__name__)
Ids = Union[Sequence[int], np.ndarray]


class _AgreedBlocks:
    """What leader and follower count alike, from the answers alone."""

    def __init__(self, layout: KVLayout, own: WorkerSpace, rank: RankDevice) -> None:
        self.layout = layout  # the deciding layout (the same on every rank: sizes derived from it agree)
        self.own = own
        self.rank = rank
        self.num_blocks = int(layout.num_blocks)
        self.first_block = 1  # the null block (SGLang's padding page)
        self.num_short_secures = 0
        self._handed_out = 0
        self._secured = 0
        self._asleep = False

    @property
    def space(self) -> Any:
        """This rank's own KV space (its tensors' memory)."""
        return self.own.space

    @property
    def secured(self) -> int:
        """Blocks the last answer left secured for the next allocations."""
        return self._secured

    def logical_free(self) -> int:
        """Engine ids not handed out, whatever memory allows (the same on every rank)."""
        return self.num_blocks - self.first_block - self._handed_out

    def free(self, ids: Ids) -> None:
        self._handed_out -= len(ids)

    @property
    def asleep(self) -> bool:
        """Between :meth:`sleep` and :meth:`wake_up` (the same on every rank)."""
        return self._asleep

    def _check_none_handed_out(self) -> None:
        # Checked alike on every rank before any message: a refused sleep leaves the ranks in step.
        if self._handed_out:
            raise IntegrationError(
                f"kvcached: cannot put the KV cache to sleep with {self._handed_out} blocks handed out "
                "(the engine must flush its cache first)"
            )


class LeaderBlocks(_AgreedBlocks):
    """The deciding rank: decides with a device-less manager and sends every answer to the followers."""

    def __init__(
        self,
        blocks: EngineBlocks,
        own: WorkerSpace,
        board: AckBoard,
        sender: DecisionSender,
        ranks: Sequence[RankDevice],
    ) -> None:
        super().__init__(blocks.layout, own, ranks[0])
        self.blocks = blocks
        self.budgets = blocks.budgets
        self.ranks = list(ranks)
        self._board = board
        self._sender = sender
        self._dropped: set[int] = set()

    @classmethod
    def open(
        cls,
        layouts: Sequence[KVLayout],
        ranks: Sequence[RankDevice],
        *,
        name: str,
        policy: MemoryPolicy,
        ack_timeout_s: float,
        logger: Optional[logging.Logger] = None,
    ) -> tuple[LeaderBlocks, dict[str, Any]]:
        """Registers every rank, builds the deciding manager and this rank's space.

        Returns the leader and what the followers need to attach (picklable).
        Each rank's registry entry carries that rank's process id, so that
        ``kvctl set-limit pid:N`` steers one rank and a dead rank's entry is stale.
        """
        budgets = register_ranks(
            name,
            ranks,
            policy=policy,
            logger=logger,
            owned_by_ranks=True,
            join=True,  # each rank's weights may be on its entry already
        )
        board = sender = own = blocks = None
        try:
            board = AckBoard.create(len(ranks))
            blocks = EngineBlocks.deciding(
                layouts, budgets, ranks=ranks, board=board, name=name, ack_timeout_s=ack_timeout_s, logger=logger
            )
            own = WorkerSpace(layouts[0], device=ranks[0].local_device, rank=0)
            sender = DecisionSender(len(ranks) - 1)
            leader = cls(blocks, own, board, sender, ranks)
            first_ops = blocks.take_page_ops()  # the null block's page
            leader._apply_own(first_ops)
        except BaseException:
            for part in (sender, own):
                if part is not None:
                    part.close()
            if blocks is not None:
                blocks.close()  # unregisters the budgets and closes the board
            else:
                for budget in budgets:
                    budget.unregister()
                if board is not None:
                    board.close()
            raise
        setup = dict(
            name=name, board_path=board.path, answer_paths=sender.paths, leader_pid=os.getpid(), first_ops=first_ops
        )
        return leader, setup

    def followers_attached(self) -> None:
        self._sender.followers_attached()

    # ---- the answers --------------------------------------------------------------

    def _apply_own(self, ops: Any) -> None:
        if ops is not None:
            self._board.publish(0, self.own.apply(ops))
            self.blocks.poll_acknowledgements()  # this rank's unmaps go back to its budget at once

    def _answer(self, kind: str, value: Any) -> Any:
        ops = self.blocks.take_page_ops()
        self._apply_own(ops)
        self._secured = self.blocks.secured
        self._sender.send((kind, value, self._secured, ops))
        return value

    def _poll(self) -> None:
        """Takes in the ranks' acknowledgements; stops sending to ranks declared lost."""
        self.blocks.poll_acknowledgements()
        for rank in self.blocks.mirrors.lost:
            if rank not in self._dropped and rank > 0:
                self._sender.drop(rank - 1)
                self._dropped.add(rank)

    def alloc(self, n: int) -> np.ndarray:
        self._poll()
        try:
            ids = self.blocks.alloc(n)
        except OutOfMemoryError:
            self._answer("alloc", None)
            raise
        self._handed_out += len(ids)
        return self._answer("alloc", ids)

    def free(self, ids: Ids) -> None:
        self.blocks.free(ids)
        super().free(ids)

    def secure(self, n: int) -> bool:
        self._poll()
        ok = self.blocks.secure(n)
        if not ok:
            self.num_short_secures += 1
        return self._answer("secure", ok)

    def available(self) -> int:
        """Blocks allocatable now on every rank's budget (the leader's answer)."""
        self._poll()
        return self._answer("available", int(self.blocks.available()))

    def agree(self, decide: Callable[[], Any]) -> Any:
        """``decide()`` here, its answer on every rank (a time- or memory-dependent choice)."""
        return self._answer("agree", decide())

    def want_more(self, missing_blocks: int = 0) -> None:
        self.blocks.want_more(missing_blocks)

    def end_step(self) -> None:
        self._poll()
        self.blocks.end_step()
        self._answer("end_step", None)

    def trim(self) -> int:
        self._poll()
        return self._answer("trim", self.blocks.trim())

    def clear(self) -> None:
        self.blocks.clear()
        self._handed_out = 0
        self._answer("clear", None)

    def sleep(self) -> int:
        """Every rank gives back every page, the null block's too, and maps nothing until
        :meth:`wake_up`; returns pages unmapped. A rank's budget has its memory back once that
        rank replayed the sleep and :meth:`poll_acknowledgements` took its word in."""
        self._check_none_handed_out()
        self._poll()
        unmapped = self._answer("sleep", self.blocks.sleep())
        self._asleep = True
        return unmapped

    def wake_up(self) -> None:
        """Every rank may allocate again and maps the null block's page back; a refusal on any
        rank's budget raises on every rank, all still asleep."""
        self._poll()
        try:
            self.blocks.wake_up()
        except Exception as exc:
            self._answer("wake_up", (type(exc).__name__, str(exc)))
            raise
        self._asleep = False
        self._answer("wake_up", None)

    def poll_acknowledgements(self) -> None:
        """Takes in what every rank applied (no message: the followers' counterpart does nothing)."""
        self._poll()

    def stats(self) -> dict:
        self._poll()
        stats = self.blocks.stats()
        stats.update(
            rank=0,
            ranks=[dict(rank=r.rank, device=r.device, local_device=r.local_device, pid=r.pid) for r in self.ranks],
            own=self.own.stats(),
        )
        return stats

    def close(self) -> None:
        """Ends the followers' answers, gives every rank's budget back, unmaps this rank's space."""
        self._sender.close()
        self.blocks.close()
        self.own.close()


class FollowerBlocks(_AgreedBlocks):
    """A rank that replays the leader's answers and maps what the leader decided, in its own space."""

    def __init__(self, layout: KVLayout, own: WorkerSpace, receiver: DecisionReceiver, rank: RankDevice) -> None:
        super().__init__(layout, own, rank)
        self.budgets: list[Any] = []  # the leader charges this rank's budget
        self._receiver = receiver

    @classmethod
    def open(cls, setup: dict[str, Any], layouts: Sequence[KVLayout], rank: RankDevice) -> FollowerBlocks:
        """Attaches to the leader's board and answers; applies the pages mapped so far."""
        board = AckBoard.attach(setup["board_path"], len(layouts))
        try:
            own = WorkerSpace(layouts[rank.rank], device=rank.local_device, rank=rank.rank, board=board)
        except BaseException:
            board.close()
            raise
        try:
            receiver = DecisionReceiver(setup["answer_paths"][rank.rank - 1], setup["leader_pid"])
            if setup["first_ops"] is not None:
                own.apply(setup["first_ops"])
        except BaseException:
            own.close()
            raise
        return cls(layouts[0], own, receiver, rank)

    def _expect(self, kind: str) -> Any:
        got, value, secured, ops = self._receiver.receive()
        if ops is not None:
            self.own.apply(ops)  # acknowledged on the board
        if got != kind:
            raise IntegrationError(
                f"kvcached: rank {self.rank.rank} asked for {kind!r} where the deciding rank answered {got!r}: "
                "the ranks' schedulers took different paths"
            )
        self._secured = secured
        return value

    def alloc(self, n: int) -> np.ndarray:
        ids = self._expect("alloc")
        if ids is None:
            raise OutOfMemoryError(f"kvcached: the deciding rank could not allocate {n} blocks for every rank")
        if len(ids) != n:
            raise IntegrationError(
                f"kvcached: rank {self.rank.rank} asked for {n} blocks, the deciding rank gave {len(ids)}"
            )
        self._handed_out += len(ids)
        return ids

    def secure(self, n: int) -> bool:
        ok = self._expect("secure")
        if not ok:
            self.num_short_secures += 1
        return ok

    def available(self) -> int:
        return self._expect("available")

    def agree(self, decide: Callable[[], Any]) -> Any:
        return self._expect("agree")

    def want_more(self) -> None:
        pass  # the leader records it on every rank's budget

    def end_step(self) -> None:
        self._expect("end_step")

    def trim(self) -> int:
        return self._expect("trim")

    def clear(self) -> None:
        self._handed_out = 0
        self._expect("clear")

    def sleep(self) -> int:
        self._check_none_handed_out()
        unmapped = self._expect("sleep")  # the unmaps come with the answer, acknowledged on the board
        self._asleep = True
        return unmapped

    def poll_acknowledgements(self) -> None:
        pass  # the leader takes them in

    def wake_up(self) -> None:
        failure = self._expect("wake_up")
        if failure is not None:
            kind, message = failure
            error = OutOfMemoryError if kind == "OutOfMemoryError" else IntegrationError
            raise error(f"kvcached: the deciding rank could not wake the KV cache: {message}")
        self._asleep = False

    def stats(self) -> dict:
        return dict(
            rank=self.rank.rank,
            asleep=self._asleep,
            engine_blocks=self.num_blocks,
            engine_used_blocks=self._handed_out,
            secured_blocks=self._secured,
            short_secures=self.num_short_secures,
            answer_wait_s=self._receiver.wait_s,
            own=self.own.stats(),
        )

    def close(self) -> None:
        self._receiver.close()
        self.own.close()


__all__ = ["FollowerBlocks", "LeaderBlocks"]
