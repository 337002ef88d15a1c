"""The error kvcached raises for vLLM 0.32 features and KV layouts it cannot serve."""

from __future__ import annotations

from kvcached.errors import KvcachedError


class UnsupportedVLLMConfig(KvcachedError, RuntimeError):
    """A vLLM feature kvcached does not support is enabled."""


__all__ = ["UnsupportedVLLMConfig"]
