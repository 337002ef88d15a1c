"""Ports for the engines: each engine of one serve gets a port no other engine of it was given.

The kernel names a free port by binding to port 0; the probe is closed at once, and the engine
binds the port seconds later, once its server is up. Until then the kernel may name the same port
again, and engines started together would share it: vLLM's server binds with ``SO_REUSEPORT``, so
both would listen and the kernel would split one model's requests between two engines.
:class:`PortBook` remembers the ports handed out until their engine is gone.
"""

from __future__ import annotations

import socket
import threading

from kvcached.errors import ServeError

# How many ports the kernel may name that this serve handed out already before giving up.
PROBES = 64


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the kernel's choice)."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class PortBook:
    """The ports handed to this serve's engines and not given back yet. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._taken: set[int] = set()

    def take(self, host: str) -> int:
        """A free port on ``host`` that no engine holds: kept for the caller until :meth:`give_back`."""
        with self._lock:
            for _ in range(PROBES):
                port = free_port(host)
                if port not in self._taken:
                    self._taken.add(port)
                    return port
        raise ServeError(f"the kernel named only ports other engines hold ({PROBES} tries on {host})")

    def give_back(self, port: int) -> None:
        """The port's engine is gone: the port may be handed out again."""
        with self._lock:
            self._taken.discard(port)

    @property
    def taken(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._taken)


__all__ = ["PortBook", "free_port"]
