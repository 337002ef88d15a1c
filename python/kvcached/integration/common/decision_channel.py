"""One deciding process's answers, in order, to the ranks that must take the same decisions.

Rationale
---------
Some engines (SGLang) run one scheduler per rank and rely on every scheduler
taking the same decisions from the same inputs. Whether memory allows a block
is not such an input: it depends on each device's budget at that moment. So
one rank decides (:class:`~kvcached.integration.common.agreed_blocks.LeaderBlocks`)
and the others replay its answers in the order they ask
(:class:`~kvcached.integration.common.agreed_blocks.FollowerBlocks`); this
module carries the answers.

Approach
--------
One pipe per follower, created by the deciding process and opened by the
follower through ``/proc/<pid>/fd/<fd>`` (the same machine and user, as for
:mod:`.acks`). Messages are length-prefixed pickles. The deciding process
never blocks on a slow follower (a pipeline stage runs a step behind): a
write that does not fit the pipe goes to an outbox that a writer thread
drains. A follower waits for its next answer as long as the deciding process
lives, and fails with a clear error when it is gone; it counts the time it
waits (a follower ahead of the deciding rank waits at every question).
"""

from __future__ import annotations

import collections
import fcntl
import os
import pickle
import select
import struct
import threading
import time
from typing import Any, Optional

from kvcached.errors import IntegrationError

_LENGTH = struct.Struct("<I")
_PIPE_BYTES = 1 << 20  # room for a step's answers of a large prefill (best effort)
_POLL_MS = 1000  # a waiting follower checks that the deciding process lives this often


class DecisionSender:
    """The deciding side: every message goes to every follower that has not been dropped."""

    def __init__(self, num_followers: int) -> None:
        self._read_fds: list[Optional[int]] = []
        self._write_fds: list[Optional[int]] = []
        self._outboxes: list[collections.deque] = [collections.deque() for _ in range(num_followers)]
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._writer: Optional[threading.Thread] = None
        self._closed = False
        try:
            for _ in range(num_followers):
                read_fd, write_fd = os.pipe2(os.O_CLOEXEC)
                self._read_fds.append(read_fd)
                self._write_fds.append(write_fd)
                try:
                    fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)
                except OSError:
                    pass  # the default pipe size works too, with the outbox taking more
                os.set_blocking(write_fd, False)
        except BaseException:
            self.close()
            raise
        self.paths = [f"/proc/{os.getpid()}/fd/{fd}" for fd in self._read_fds]

    def followers_attached(self) -> None:
        """Every follower has opened its pipe: drop this process's read ends (a dead follower then breaks its pipe)."""
        for i, fd in enumerate(self._read_fds):
            if fd is not None:
                os.close(fd)
                self._read_fds[i] = None

    def drop(self, follower: int) -> None:
        """Stops sending to ``follower`` (its process is gone or it was declared lost)."""
        with self._lock:
            fd = self._write_fds[follower]
            self._write_fds[follower] = None
            self._outboxes[follower].clear()
        if fd is not None:
            os.close(fd)

    def send(self, message: Any) -> None:
        """Sends ``message`` to every follower, in order; never blocks on a slow one."""
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        frame = _LENGTH.pack(len(payload)) + payload
        with self._lock:
            for follower, fd in enumerate(self._write_fds):
                if fd is None:
                    continue
                outbox = self._outboxes[follower]
                if not outbox:
                    try:
                        written = os.write(fd, frame)
                    except BlockingIOError:
                        written = 0
                    except BrokenPipeError:
                        self._write_fds[follower] = None
                        os.close(fd)
                        continue
                    if written == len(frame):
                        continue
                    outbox.append(memoryview(frame)[written:])
                else:
                    outbox.append(memoryview(frame))
                self._start_writer()
                self._wake.notify()

    def _start_writer(self) -> None:
        if self._writer is None:
            self._writer = threading.Thread(target=self._drain, name="kvcached-decisions", daemon=True)
            self._writer.start()

    def _drain(self) -> None:
        """Writer thread: waits until a follower's pipe has room, writes what its outbox holds."""
        while True:
            with self._lock:
                while not self._closed and not any(self._outboxes):
                    self._wake.wait()
                if self._closed:
                    return
                pending = [(i, self._write_fds[i]) for i, box in enumerate(self._outboxes) if box]
            poller = select.poll()
            for _, fd in pending:
                if fd is not None:
                    poller.register(fd, select.POLLOUT)
            poller.poll(_POLL_MS)
            with self._lock:
                for follower, fd in pending:
                    if fd is None or self._write_fds[follower] != fd:
                        continue
                    outbox = self._outboxes[follower]
                    while outbox:
                        chunk = outbox[0]
                        try:
                            written = os.write(fd, chunk)
                        except BlockingIOError:
                            break
                        except BrokenPipeError:
                            outbox.clear()
                            self._write_fds[follower] = None
                            os.close(fd)
                            break
                        if written == len(chunk):
                            outbox.popleft()
                        else:
                            outbox[0] = chunk[written:]
                            break

    def close(self) -> None:
        """Closes every pipe (followers then read end of file). Idempotent."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            for fds in (self._read_fds, self._write_fds):
                for i, fd in enumerate(fds):
                    if fd is not None:
                        os.close(fd)
                        fds[i] = None


class DecisionReceiver:
    """A follower's end: the deciding process's messages, in the order they were sent."""

    def __init__(self, path: str, leader_pid: int, *, is_alive: Any = None) -> None:
        from kvcached.integration.common.mirrors import process_alive

        try:
            self._fd: Optional[int] = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            raise IntegrationError(
                f"kvcached: cannot open the deciding rank's answers at {path} ({exc.strerror}); every rank "
                "must run on the deciding rank's host, as the same user"
            ) from None
        self.leader_pid = leader_pid
        self._is_alive = is_alive or process_alive
        self._buffer = bytearray()
        self.wait_s = 0.0  # time spent waiting for the deciding process's next answer

    def receive(self) -> Any:
        """The next message; waits as long as the deciding process lives."""
        while True:
            if len(self._buffer) >= _LENGTH.size:
                (length,) = _LENGTH.unpack_from(self._buffer)
                end = _LENGTH.size + length
                if len(self._buffer) >= end:
                    message = pickle.loads(bytes(self._buffer[_LENGTH.size : end]))
                    del self._buffer[:end]
                    return message
            self._fill()

    def _fill(self) -> None:
        if self._fd is None:
            raise IntegrationError("kvcached: the deciding rank's answers were closed")
        began = time.perf_counter()
        chunk = self._read()
        if chunk is None:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            while chunk is None:
                if not poller.poll(_POLL_MS) and not self._is_alive(self.leader_pid):
                    raise IntegrationError(
                        f"kvcached: the deciding rank (process {self.leader_pid}) is gone; this rank cannot go on"
                    )
                chunk = self._read()
        self.wait_s += time.perf_counter() - began
        if not chunk:
            raise IntegrationError(
                f"kvcached: the deciding rank (process {self.leader_pid}) stopped sending its decisions "
                "(it shut down or failed); this rank cannot go on"
            )
        self._buffer += chunk

    def _read(self) -> Optional[bytes]:
        """What the pipe holds now (``b""`` at its end), or None while it is empty."""
        try:
            return os.read(self._fd, _PIPE_BYTES)
        except BlockingIOError:
            return None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["DecisionReceiver", "DecisionSender"]
