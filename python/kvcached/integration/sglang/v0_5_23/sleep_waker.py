"""Waking SGLang's idle sleep when an idle engine's memory hold ends, or the device wants the memory.

With ``--sleep-on-idle`` an idle scheduler blocks in its ``IdleSleeper``'s
zmq poller until a request comes (or 1 s). An engine that holds its memory
for ``KVCACHED_IDLE_RELEASE_S`` must give it back when the hold ends, or at
once when another instance of the device wants it, without waking up
SGLang's idle housekeeping every few milliseconds meanwhile. So the read end
of a pipe joins SGLang's poller, and the idle hold's watching thread
(:meth:`IdleRelease.wake_when_due`) writes a byte into it: the sleep ends
exactly then, and the next idle turn gives the memory back.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from kvcached.integration.common.idle import IdleRelease

__all__ = ["SleepWaker"]


class SleepWaker:
    """A pipe in one SGLang idle sleeper's poller, written when the idle hold is due."""

    def __init__(self) -> None:
        self._poller: Any = None
        self._read_fd: Optional[int] = None
        self._write_fd: Optional[int] = None

    def arm(self, idle: IdleRelease, sleeper: Any) -> bool:
        """Has ``sleeper``'s next sleep end when ``idle`` is due; False if it has no zmq poller."""
        poller = getattr(sleeper, "poller", None)
        if poller is None:
            return False  # another sleeper (SGLang's Rust ingress): it wakes by its own timeout
        if poller is not self._poller:
            self.close()
            self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
            poller.register(self._read_fd)  # zmq.Poller takes plain file descriptors too (POLLIN)
            self._poller = poller
        self.drain()
        idle.wake_when_due(self._wake)
        return True

    def drain(self) -> None:
        """Empties the pipe, so that a past wake-up does not end the next sleep at once."""
        if self._read_fd is None:
            return
        try:
            while os.read(self._read_fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._poller is not None and self._read_fd is not None:
            try:
                self._poller.unregister(self._read_fd)
            except KeyError:
                pass
        for fd in (self._read_fd, self._write_fd):
            if fd is not None:
                os.close(fd)
        self._poller = self._read_fd = self._write_fd = None

    def _wake(self) -> None:  # on the idle hold's watching thread
        fd = self._write_fd
        if fd is not None:
            try:
                os.write(fd, b"\0")
            except BlockingIOError:  # the pipe is full: a wake-up is pending anyway
                pass
