"""Fake engines with a sleep API and a fake device registry, for the tests of serve's sleeping models.

Each fake engine is a small HTTP server speaking vLLM's (``/sleep``, ``/wake_up``,
``/collective_rpc``) or SGLang's (``/release_memory_occupation``, ``/resume_memory_occupation``,
``/update_weights_from_disk``) sleep API; sleeping sets its weights to 0 in the fake registry and
waking back, as kvcached does in a real engine, and every call is logged in order.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kvcached.serve.memory import ModelMemory
from kvcached.serve.spec import ModelSpec, ServeConfig, SleepPolicy
from kvcached.serve.supervisor import EngineState

MiB = 1 << 20


class FakeMemory:
    """What serve reads of the registry: each model's weights and KV, and the budget."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.models: dict[str, dict] = {}
        self.lock = threading.Lock()

    def set(self, name: str, **fields: int) -> None:
        with self.lock:
            self.models.setdefault(name, {}).update(fields)

    def usage(self) -> dict[str, ModelMemory]:
        with self.lock:
            return {name: ModelMemory(**fields, entries=1) for name, fields in self.models.items()}

    def held(self) -> int:
        return sum(m.weights_bytes + m.mapped_bytes for m in self.usage().values())


@dataclasses.dataclass
class FakeSleepyEngine:
    """A fake engine's state for the supervisor's side: ready, with a base URL."""

    spec: ModelSpec
    base_url: str
    state: EngineState = EngineState.READY

    @property
    def url(self) -> Optional[str]:
        return self.base_url if self.state is EngineState.READY else None


def sleepy_engine(name: str, engine: str, memory: FakeMemory, weights_bytes: int, calls: list, fail_wake=None):
    """An engine app: sleeping gives its weights back in ``memory``, waking takes them again."""
    app = FastAPI()
    memory.set(name, weights_bytes=weights_bytes, mapped_bytes=0, used_bytes=0)

    def asleep() -> None:
        memory.set(name, weights_bytes=0, mapped_bytes=0, sleeping=True)

    def awake() -> Response:
        if fail_wake is not None and fail_wake.is_set():
            return JSONResponse({"error": "out of memory"}, status_code=500)
        memory.set(name, weights_bytes=weights_bytes, sleeping=False)
        return JSONResponse({})

    async def call(request: Request, what: str) -> Response:
        calls.append((name, what, dict(request.query_params)))
        if what in ("sleep", "release_memory_occupation"):
            asleep()
            return JSONResponse({})
        if what in ("wake_up", "resume_memory_occupation"):
            if request.query_params.get("tags") == "kv_cache":
                return JSONResponse({})
            return awake()
        return JSONResponse({})

    def route(what: str):
        async def handle(request: Request) -> Response:
            return await call(request, what)

        return handle

    for what in (
        "sleep",
        "wake_up",
        "collective_rpc",
        "release_memory_occupation",
        "resume_memory_occupation",
        "update_weights_from_disk",
    ):
        app.add_api_route(f"/{what}", route(what), methods=["POST"])

    async def complete(request: Request) -> Response:
        return JSONResponse({"model": name, "choices": [{"text": "ok"}]})

    app.add_api_route("/v1/completions", complete, methods=["POST"])
    return app


def sleepy_config(
    models: list[tuple[str, str, Optional[SleepPolicy], int]], wake_timeout_s: float = 5.0
) -> ServeConfig:
    """A config of (name, engine, sleep, priority) models."""
    from kvcached.registry import MemoryPolicy

    specs = tuple(
        ModelSpec(name, engine, f"/models/{name}", "python", "m", sleep=sleep, memory=MemoryPolicy(priority=priority))
        for name, engine, sleep, priority in models
    )
    return ServeConfig("127.0.0.1", 0, "cpu", specs, wake_timeout_s=wake_timeout_s)


__all__ = ["FakeMemory", "FakeSleepyEngine", "MiB", "sleepy_config", "sleepy_engine"]
