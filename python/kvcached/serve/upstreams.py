"""The router's connections to the engines: one HTTP client, with its own pool, per engine.

A single pool shared by every engine lets one model's load starve the others: 100 long streams to
one model held all 100 connections of a shared pool, and a one-token request to an idle model
waited for one of them to end. So each engine gets a client of its own, with at most
:data:`CONNECTIONS_PER_ENGINE` connections (every request in flight to that engine holds one,
a stream until it ends). A request that finds them all taken waits at most
:data:`POOL_TIMEOUT_S` for one, then is answered 503 (``Retry-After``) rather than left hanging;
other engines' requests never wait on it. The limits are far above what a CPU engine runs at once
and at vLLM's default batch size on a GPU (256 sequences): engines queue what they cannot run.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
from collections.abc import Iterable

import httpx

logger = logging.getLogger(__name__)

#: Requests in flight to one engine at most (each holds one connection for as long as it streams).
CONNECTIONS_PER_ENGINE = 512
#: How long a request waits for one of its engine's connections before it is answered 503.
POOL_TIMEOUT_S = 30.0
#: Idle connections kept open per engine for the next request.
KEEPALIVE_PER_ENGINE = 64
CONNECT_TIMEOUT_S = 10.0
WRITE_TIMEOUT_S = 60.0
# Each request in flight holds two descriptors: the client's connection and the engine's.
_DESCRIPTORS_PER_REQUEST = 2
_DESCRIPTORS_SPARE = 1024


@dataclasses.dataclass(frozen=True)
class UpstreamLimits:
    """Per-engine connection limits (the defaults are the documented ones)."""

    connections: int = CONNECTIONS_PER_ENGINE
    pool_timeout_s: float = POOL_TIMEOUT_S
    keepalive: int = KEEPALIVE_PER_ENGINE


DEFAULT_LIMITS = UpstreamLimits()


class Upstreams:
    """One ``httpx.AsyncClient`` per model's engine."""

    def __init__(self, model_names: Iterable[str], limits: UpstreamLimits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        # No read timeout: a long generation streams (or thinks) for as long as it needs.
        timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=WRITE_TIMEOUT_S, pool=limits.pool_timeout_s)
        pool = httpx.Limits(max_connections=limits.connections, max_keepalive_connections=limits.keepalive)
        self._clients = {name: httpx.AsyncClient(timeout=timeout, limits=pool) for name in model_names}
        raise_descriptor_limit(len(self._clients) * limits.connections * _DESCRIPTORS_PER_REQUEST)

    def client(self, model: str) -> httpx.AsyncClient:
        """The client of ``model``'s engine (``model`` must be configured)."""
        return self._clients[model]

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()


def raise_descriptor_limit(wanted: int) -> None:
    """Raises this process's soft limit on open files towards ``wanted`` (plus room for the rest),
    as far as the hard limit allows, so full pools do not run out of descriptors."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted + _DESCRIPTORS_SPARE
    if hard != resource.RLIM_INFINITY:
        target = min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
        if target < wanted:
            logger.warning(
                "the open-file limit (%d) is below what full connection pools need (%d): raise it (ulimit -n)",
                target,
                wanted,
            )


__all__ = [
    "CONNECTIONS_PER_ENGINE",
    "DEFAULT_LIMITS",
    "POOL_TIMEOUT_S",
    "UpstreamLimits",
    "Upstreams",
    "raise_descriptor_limit",
]
