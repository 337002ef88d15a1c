"""What ``kvcached serve`` runs, as checked values: the whole configuration, each model, restarts.

:mod:`kvcached.serve.config` reads them from YAML (and checks them there); every other part of
serve takes them as they are. A model's memory policy is the registry's own
:class:`~kvcached.registry.MemoryPolicy`, passed whole to its engine.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Optional

from kvcached.registry import MemoryPolicy

# A tiny random model starts in under a minute on a CPU; a 70B model from a slow disk can take many.
DEFAULT_STARTUP_TIMEOUT_S = 900.0
DEFAULT_STOP_TIMEOUT_S = 30.0
# How long a request for a sleeping model waits for it to wake (models put to sleep first, a level-2
# model's weights loaded again) before it is answered 503.
DEFAULT_WAKE_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class SleepPolicy:
    """A model that may sleep while idle: ``level`` 1 keeps its weights in host memory, 2 discards
    them (loaded again from the model on wake); with ``idle_s`` it sleeps on its own after that many
    idle seconds, else only when another model needs its memory."""

    level: int = 1
    idle_s: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One served model: its engine process and its memory policy."""

    name: str
    engine: str
    model: str
    python: str
    module: str
    args: tuple[str, ...] = ()
    python_written: str = ""  # ``python`` as the config wrote it, for messages (``python`` is absolute)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    memory: MemoryPolicy = MemoryPolicy()
    sleep: Optional[SleepPolicy] = None  # None: never put to sleep


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """How a crashed engine comes back: after ``backoff_s``, doubling up to ``max_backoff_s``,
    at most ``max_attempts`` times in a row."""

    max_attempts: int = 5
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def delay_s(self, attempt: int) -> float:
        """Seconds to wait before restart number ``attempt`` (1, 2, ...)."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """A whole, checked ``kvcached serve`` configuration."""

    host: str
    port: int
    device: str
    models: tuple[ModelSpec, ...]
    budget_bytes: Optional[int] = None
    log_dir: Optional[str] = None
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    stop_timeout_s: float = DEFAULT_STOP_TIMEOUT_S
    wake_timeout_s: float = DEFAULT_WAKE_TIMEOUT_S
    restart: RestartPolicy = RestartPolicy()

    @property
    def can_sleep(self) -> bool:
        """Whether any model may be put to sleep (serve then starts the models in turn)."""
        return any(spec.sleep is not None for spec in self.models)

    def model(self, name: str) -> Optional[ModelSpec]:
        """The model clients call ``name``, or None."""
        return next((spec for spec in self.models if spec.name == name), None)


__all__ = [
    "DEFAULT_STARTUP_TIMEOUT_S",
    "DEFAULT_STOP_TIMEOUT_S",
    "DEFAULT_WAKE_TIMEOUT_S",
    "ModelSpec",
    "RestartPolicy",
    "ServeConfig",
    "SleepPolicy",
]
