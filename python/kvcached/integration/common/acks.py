"""How every rank acknowledges the page operations it applied: a small board in shared memory.

Rationale
---------
A deciding block manager releases a page on a rank's device budget only after
*that* rank has unmapped it, and reuses a page id only once every rank has.
Engines return one rank's output to the deciding process (vLLM: the output
rank's ``ModelRunnerOutput``), so acknowledgements need a channel of their own
that every rank writes and the deciding process can read at any time, without
a message round trip and without depending on which rank reports.

Approach
--------
The deciding process creates an anonymous shared-memory file (``memfd``) of
one 64-bit word per rank and names it by its ``/proc/<pid>/fd/<fd>`` path;
each rank opens that path once and, after applying a batch, stores the batch's
seq in its word (an aligned 8-byte store: readers never see a torn value). The
deciding process reads the words whenever it decides and acknowledges what
advanced. Nothing outlives the processes (the file has no name), and only the
same user can open it (``/proc/<pid>/fd`` needs the owner's permission).

Limitations
-----------
One machine: every rank must run on the deciding process's host (checked by
the integrations; multi-host engines are refused).
"""

from __future__ import annotations

import mmap
import os
from typing import Optional

from kvcached.errors import IntegrationError, InvalidArgumentError

_WORD_BYTES = 8


class AckBoard:
    """One word per rank: the seq of the last page-op batch that rank applied (0: none)."""

    def __init__(self, fd: int, path: str, num_ranks: int) -> None:
        self.path = path
        self.num_ranks = num_ranks
        self._fd: Optional[int] = fd
        self._map = mmap.mmap(fd, num_ranks * _WORD_BYTES)
        # Plain words, no numpy: the deciding process reads them twice per engine step.
        self._seqs = memoryview(self._map).cast("Q")[:num_ranks]

    @classmethod
    def create(cls, num_ranks: int) -> AckBoard:
        """A new board for ``num_ranks`` ranks (in the deciding process)."""
        if num_ranks <= 0:
            raise InvalidArgumentError(f"an acknowledgement board needs at least one rank, got {num_ranks}")
        fd = os.memfd_create("kvcached-acks", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, num_ranks * _WORD_BYTES)
            return cls(fd, f"/proc/{os.getpid()}/fd/{fd}", num_ranks)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, path: str, num_ranks: int) -> AckBoard:
        """The board at ``path`` (in a rank's process, on the deciding process's host)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise IntegrationError(
                f"kvcached: cannot open the acknowledgement board {path} ({exc.strerror}); every rank "
                "must run on the host of the process that decides blocks, as the same user"
            ) from None
        try:
            if os.fstat(fd).st_size < num_ranks * _WORD_BYTES:
                raise IntegrationError(f"kvcached: {path} is not an acknowledgement board for {num_ranks} ranks")
            return cls(fd, path, num_ranks)
        except BaseException:
            os.close(fd)
            raise

    def publish(self, rank: int, seq: int) -> None:
        """Rank ``rank`` has applied every batch up to ``seq``."""
        self._seqs[rank] = seq

    def seqs(self) -> list[int]:
        """Every rank's last applied seq, in rank order."""
        return self._seqs.tolist()

    def close(self) -> None:
        """Unmaps the board (idempotent); the file goes when its last holder closes it."""
        if self._fd is None:
            return
        self._seqs.release()
        del self._seqs
        self._map.close()
        os.close(self._fd)
        self._fd = None


__all__ = ["AckBoard"]
