"""Putting an engine to sleep and waking it, through the engine's own HTTP API (kvcached serves it).

vLLM (``--enable-sleep-mode``, development endpoints on): ``POST /sleep?level=N`` and
``POST /wake_up``; after a level-2 sleep the weights are woken, loaded again from the model
(``POST /collective_rpc`` ``reload_weights``) and only then the KV cache. SGLang
(``--enable-memory-saver``, with ``--enable-weights-cpu-backup`` at level 1):
``POST /release_memory_occupation`` and ``/resume_memory_occupation``; after level 2 the
weights are loaded again with ``POST /update_weights_from_disk``. Each call raises
:class:`EngineSleepError` with the engine's own words when it does not answer 200.
"""

from __future__ import annotations

from typing import Any, Optional

import httpx

from kvcached.errors import ServeError
from kvcached.serve.spec import ModelSpec

# A level-1 wake of a large model copies its weights back; a level-2 wake reads them from disk.
CALL_TIMEOUT_S = 600.0


class EngineSleepError(ServeError):
    """The engine refused to sleep or wake, or did not answer; the message says which and why."""


def _call(client: httpx.Client, method: str, url: str, what: str, **kwargs: Any) -> None:
    try:
        answer = client.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        raise EngineSleepError(f"{what}: the engine did not answer ({str(exc) or type(exc).__name__})") from None
    if answer.status_code != 200:
        raise EngineSleepError(f"{what}: the engine answered {answer.status_code}: {answer.text[:300]}")


def put_to_sleep(spec: ModelSpec, base_url: str, client: Optional[httpx.Client] = None) -> None:
    """Puts the engine of ``spec`` (idle: nothing in flight) to sleep at its level."""
    assert spec.sleep is not None
    with _client(client) as http:
        if spec.engine == "vllm":
            _call(http, "POST", f"{base_url}/sleep", "sleep", params={"level": spec.sleep.level})
        else:
            _call(http, "POST", f"{base_url}/release_memory_occupation", "release_memory_occupation", json={})


def wake(spec: ModelSpec, base_url: str, client: Optional[httpx.Client] = None) -> None:
    """Wakes the engine of ``spec``: weights (loaded again after a level-2 sleep), then the KV cache."""
    assert spec.sleep is not None
    discarded = spec.sleep.level == 2
    with _client(client) as http:
        if spec.engine == "vllm":
            if discarded:
                _call(http, "POST", f"{base_url}/wake_up", "wake_up weights", params={"tags": "weights"})
                _call(http, "POST", f"{base_url}/collective_rpc", "reload_weights", json={"method": "reload_weights"})
                _call(http, "POST", f"{base_url}/wake_up", "wake_up kv_cache", params={"tags": "kv_cache"})
            else:
                _call(http, "POST", f"{base_url}/wake_up", "wake_up")
        else:
            _call(http, "POST", f"{base_url}/resume_memory_occupation", "resume_memory_occupation", json={})
            if discarded:
                _call(
                    http,
                    "POST",
                    f"{base_url}/update_weights_from_disk",
                    "update_weights_from_disk",
                    json={"model_path": spec.model},
                )


class _client:
    """The caller's client, or one of our own for the call's duration."""

    def __init__(self, client: Optional[httpx.Client]) -> None:
        self._given = client
        self._own: Optional[httpx.Client] = None

    def __enter__(self) -> httpx.Client:
        if self._given is not None:
            return self._given
        self._own = httpx.Client(timeout=CALL_TIMEOUT_S)
        return self._own

    def __exit__(self, *exc: object) -> None:
        if self._own is not None:
            self._own.close()


__all__ = ["EngineSleepError", "put_to_sleep", "wake"]
