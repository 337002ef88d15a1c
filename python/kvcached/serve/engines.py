"""The engines ``kvcached serve`` starts: each one's command line, environment and health check.

Every engine is the engine's own OpenAI-compatible server, started as ``python -m MODULE``
in its own environment (``python:``), with kvcached switched on and named after the model,
listening on a free local port that only the router uses.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from kvcached.config import OPTIONS
from kvcached.errors import ServeConfigError
from kvcached.registry import MemoryPolicy

if TYPE_CHECKING:
    from kvcached.serve.spec import ModelSpec

ENGINE_HOST = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """How one engine's server is started and asked whether it is ready."""

    name: str
    package: str  # what its Python must be able to import
    module: str  # its OpenAI-compatible server, run as ``python -m``
    model_flag: str
    #: Answers 200 only once the engine can generate (SGLang's /health answers before its scheduler is warm).
    ready_path: str
    owned_flags: tuple[str, ...]
    #: What turns the engine's own sleep API on, by sleep level (kvcached then serves it).
    sleep_flags: Mapping[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    sleep_env: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def command(self, spec: ModelSpec, port: int) -> list[str]:
        """The engine's command line: the model, its OpenAI name, the port serve chose, its sleep API
        when the model may sleep, then ``args``."""
        sleeping = self.sleep_flags[spec.sleep.level] if spec.sleep is not None else ()
        return [
            spec.python,
            "-m",
            spec.module,
            self.model_flag,
            spec.model,
            "--served-model-name",
            spec.name,
            "--host",
            ENGINE_HOST,
            "--port",
            str(port),
            *sleeping,
            *spec.args,
        ]


ENGINES: dict[str, EngineKind] = {
    "vllm": EngineKind(
        name="vllm",
        package="vllm",
        module="vllm.entrypoints.openai.api_server",
        model_flag="--model",
        ready_path="/health",
        owned_flags=("--model", "--served-model-name", "--host", "--port"),
        sleep_flags={1: ("--enable-sleep-mode",), 2: ("--enable-sleep-mode",)},
        # /sleep, /wake_up and /collective_rpc are vLLM's development endpoints; only the router reaches them.
        sleep_env={"VLLM_SERVER_DEV_MODE": "1"},
    ),
    "sglang": EngineKind(
        name="sglang",
        package="sglang",
        module="sglang.launch_server",
        model_flag="--model-path",
        ready_path="/health_generate",
        owned_flags=("--model-path", "--model", "--served-model-name", "--host", "--port"),
        sleep_flags={
            1: ("--enable-memory-saver", "--enable-weights-cpu-backup"),
            2: ("--enable-memory-saver",),
        },
    ),
}
OWNED_ARGUMENTS: dict[str, tuple[str, ...]] = {name: kind.owned_flags for name, kind in ENGINES.items()}

# The options serve decides for every engine (their variables, older names included); inherited
# values would name or size the wrong instance.
_OWNED_OPTIONS = ("enable", "name", "max_bytes", "min_bytes", "priority")
POLICY_VARIABLES = tuple(env for key in _OWNED_OPTIONS for env in (OPTIONS[key].env, *OPTIONS[key].aliases))
_VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "hip": "HIP_VISIBLE_DEVICES"}


def _visible_device(base: Mapping[str, str], variable: str, ordinal: int) -> str:
    """The value that shows the engine only GPU ``ordinal`` of the ones serve sees."""
    visible = [d.strip() for d in base.get(variable, "").split(",") if d.strip()]
    if not visible:
        return str(ordinal)
    if ordinal >= len(visible):
        raise ServeConfigError(f"device: {variable}={base[variable]!r} shows no GPU {ordinal}")
    return visible[ordinal]


def engine_environment(spec: ModelSpec, device: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The engine's environment: ``base`` (default: serve's own) without inherited policy settings,
    kvcached on under the model's name with its memory policy, the one device, then ``env:``."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if k not in POLICY_VARIABLES}
    env[OPTIONS["enable"].env] = "1"
    env[OPTIONS["name"].env] = spec.name
    env.update(policy_environment(spec.memory))
    if spec.sleep is not None:
        env.update(ENGINES[spec.engine].sleep_env)
    kind, _, ordinal = device.partition(":")
    if kind in _VISIBLE_DEVICES:
        env[_VISIBLE_DEVICES[kind]] = _visible_device(env, _VISIBLE_DEVICES[kind], int(ordinal or 0))
    env.update(spec.env)
    return env


def policy_environment(policy: MemoryPolicy) -> dict[str, str]:
    """The variables that give an engine ``policy`` (what its integration reads back into the same value)."""
    env = {OPTIONS["min_bytes"].env: str(policy.min_bytes), OPTIONS["priority"].env: str(policy.priority)}
    if policy.max_bytes is not None:
        env[OPTIONS["max_bytes"].env] = str(policy.max_bytes)
    return env


def check_environment(spec: ModelSpec, index: int, device: str) -> None:
    """Refuses a ``python`` that cannot run the engine: with the model's own environment it must
    import what the engine will import (:mod:`kvcached.serve.python_probe`): ``module``, the
    engine's server, kvcached and kvcached's plugin, which must support the engine's version."""
    from kvcached.serve.python_probe import probe_python

    problem = probe_python(
        spec.python,
        engine_environment(spec, device),
        spec.engine,
        spec.module,
        ENGINES[spec.engine].module,
        f"kvcached.integration.{spec.engine}",
    )
    if problem is not None:
        written = spec.python_written or spec.python
        shown = repr(spec.python) if written == spec.python else f"{written!r} ({spec.python})"
        raise ServeConfigError(f"models[{index}].python: {shown} {problem}")


__all__ = [
    "ENGINES",
    "ENGINE_HOST",
    "OWNED_ARGUMENTS",
    "POLICY_VARIABLES",
    "EngineKind",
    "check_environment",
    "engine_environment",
    "policy_environment",
]
