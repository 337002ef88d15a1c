"""kvcached's options: one table, each overridable by one ``KVCACHED_*`` environment variable.

Values are read when a pool (or device budget) is created, so a process can
set them before it builds its KV cache. ``docs/configuration.md`` documents the
same table; a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _parse_size(text: str) -> int:
    """Bytes, with an optional K/M/G/T suffix (powers of 1024)."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    stripped = text.strip().lower().removesuffix("ib").removesuffix("b")
    factor = units.get(stripped[-1:], 1) if stripped else 1
    number = stripped[:-1] if factor != 1 else stripped
    value = int(float(number) * factor)
    if value < 0:
        raise ValueError(f"sizes must not be negative, got {text!r}")
    return value


def _parse_fraction(text: str) -> float:
    value = float(text)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def _parse_layout(text: str) -> str:
    value = text.strip().lower()
    if value not in ("per_layer", "contiguous"):
        raise ValueError(f"expected 'per_layer' or 'contiguous', got {text!r}")
    return value


def _parse_count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"expected a non-negative integer, got {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Option(Generic[T]):
    env: str
    default: T
    parse: Callable[[str], T]
    doc: str

    def get(self) -> T:
        text = os.environ.get(self.env)
        if text is None or text == "":
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"{self.env}={text!r} is invalid: {exc}") from None


OPTIONS: dict[str, Option] = {
    "page_bytes": Option(
        "KVCACHED_PAGE_BYTES", 0, _parse_size,
        "Page size per layer and buffer (0: the device's recommended granularity, 2 MiB on CUDA and host).",
    ),
    "layout": Option(
        "KVCACHED_LAYOUT", "per_layer", _parse_layout,
        "KV layout: per_layer (each layer's blocks packed) or contiguous (one compound page per page id).",
    ),
    "zero_backing": Option(
        "KVCACHED_ZERO_BACKING", True, _parse_bool,
        "Unmapped regions read as zeros, so stray reads by kernels never fault.",
    ),
    "zero_chunk_bytes": Option(
        "KVCACHED_ZERO_CHUNK_BYTES", 256 << 20, _parse_size,
        "Largest zero-filled allocation used for zero backing on GPUs (shared by the pools of a process).",
    ),
    "min_reserve_pages": Option(
        "KVCACHED_MIN_RESERVE_PAGES", 1, _parse_count,
        "Mapped free pages the background worker keeps ready for alloc.",
    ),
    "max_reserve_pages": Option(
        "KVCACHED_MAX_RESERVE_PAGES", 4, _parse_count,
        "Mapped free pages beyond which the worker gives memory back.",
    ),
    "min_spare_pages": Option(
        "KVCACHED_MIN_SPARE_PAGES", 0, _parse_count,
        "Pre-created (unmapped) physical allocations the worker keeps ready.",
    ),
    "max_spare_pages": Option(
        "KVCACHED_MAX_SPARE_PAGES", 2, _parse_count,
        "Unmapped allocations kept for reuse instead of being released.",
    ),
    "gpu_utilization": Option(
        "KVCACHED_GPU_UTILIZATION", 0.9, _parse_fraction,
        "Share of device memory the kvcached instances of one device may map together.",
    ),
    "virtual_capacity_bytes": Option(
        "KVCACHED_VIRTUAL_CAPACITY_BYTES", 0, _parse_size,
        "Virtual KV capacity of a pool when none is given (0: the device's total memory).",
    ),
}


def get(name: str):
    """Current value of option ``name`` (environment variable, else default)."""
    return OPTIONS[name].get()


__all__ = ["OPTIONS", "Option", "get"]
