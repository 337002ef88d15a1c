"""kvcached's options: one table, each overridable by one ``KVCACHED_*`` environment variable.

Values are read when a pool (or device budget) is created, so a process can
set them before it builds its KV cache. ``docs/configuration.md`` documents the
same table; a test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable, Generic, Optional, TypeVar

from kvcached.errors import ConfigurationError
from kvcached.sizes import parse_bytes

T = TypeVar("T")


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean (1/0, true/false), got {text!r}")


def _parse_size(text: str) -> int:
    """A size in the package's one grammar (:mod:`kvcached.sizes`): 4096, 512MiB, 8G, 2GB."""
    return parse_bytes(text)


def _parse_positive_size(text: str) -> int:
    value = parse_bytes(text)
    if value == 0:
        raise ValueError("expected more than 0 bytes")
    return value


def _parse_text(text: str) -> str:
    return text


def _parse_instance_name(text: str) -> str:
    from kvcached._core import validate_instance_name

    validate_instance_name(text)
    return text


def _parse_directory(text: str) -> str:
    if not text.startswith("/"):
        raise ValueError("expected an absolute path (processes started elsewhere would disagree)")
    return text


def _parse_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number in (0, 1], e.g. 0.9, got {text!r}") from None
    if not 0.0 < value <= 1.0:  # also refuses nan
        raise ValueError(f"expected a fraction in (0, 1], got {text!r}")
    return value


def _parse_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number of seconds, e.g. 120, got {text!r}") from None
    if not value > 0.0 or value == float("inf"):  # also refuses nan
        raise ValueError(f"expected a positive, finite number of seconds, got {text!r}")
    return value


def _parse_seconds_or_zero(text: str) -> float:
    """A number of seconds >= 0 (0 meaning "at once")."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"expected a number of seconds, e.g. 5, got {text!r}") from None
    if not value >= 0.0 or value == float("inf"):  # also refuses nan
        raise ValueError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def _parse_layout(text: str) -> str:
    value = text.strip().lower()
    if value not in ("per_layer", "contiguous"):
        raise ValueError(f"expected 'per_layer' or 'contiguous', got {text!r}")
    return value


HOST_MEMORY_KINDS = ("anonymous", "huge_pages", "shared_files")
HOST_POPULATE_WAYS = ("background", "on_touch")


def _one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    """A parser accepting exactly one of ``choices``."""
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}, got {text!r}")
        return text
    return parse


def _parse_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise ValueError(f"expected a non-negative integer, got {text!r}")
    return value


@dataclasses.dataclass(frozen=True)
class Option(Generic[T]):
    """One option: its variable, its default (used when unset or empty), its parser and meaning."""

    env: str
    default: T
    parse: Callable[[str], T]
    doc: str
    #: Older names still honoured when ``env`` is unset.
    aliases: tuple[str, ...] = ()

    def get(self) -> T:
        env = next((name for name in (self.env, *self.aliases) if os.environ.get(name)), self.env)
        text = os.environ.get(env)
        if text is None or text == "":
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            reason = str(exc)
            if reason.startswith(f"{text!r} "):  # the size parser quotes the text itself
                raise ConfigurationError(f"{env}={reason}") from None
            raise ConfigurationError(f"{env}={text!r} is invalid: {reason}") from None


OPTIONS: dict[str, Option] = {
    "page_bytes": Option(
        "KVCACHED_PAGE_BYTES", 0, _parse_size,
        "Page size per layer and buffer (0: the device's recommended granularity, 2 MiB on CUDA and host).",
    ),
    "layout": Option(
        "KVCACHED_LAYOUT", None, _parse_layout,
        "KV layout: per_layer (each layer's blocks packed) or contiguous (one compound page per page id); "
        "unset: the device kind's default (kvcached.layout.DEFAULT_LAYOUTS: contiguous everywhere).",
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
        "KVCACHED_MIN_SPARE_PAGES", 1, _parse_count,
        "Pre-created (unmapped) physical allocations the worker keeps ready, so a grow rarely creates.",
    ),
    "max_spare_pages": Option(
        "KVCACHED_MAX_SPARE_PAGES", 2, _parse_count,
        "Unmapped allocations kept for reuse; more are released by the worker's next round.",
    ),
    "zero_frontier_pages": Option(
        "KVCACHED_ZERO_FRONTIER_PAGES", 64, _parse_count,
        "Unmapped page ids kept split ahead of use on GPUs (zero backing), at least; the worker keeps "
        "twice the largest recent grow.",
    ),
    "gpu_utilization": Option(
        "KVCACHED_GPU_UTILIZATION", 0.9, _parse_fraction,
        "Share of device memory the kvcached instances of one device may map together.",
    ),
    "virtual_capacity_bytes": Option(
        "KVCACHED_VIRTUAL_CAPACITY_BYTES", 0, _parse_size,
        "Virtual KV capacity of a pool when none is given (0: the device's total memory).",
    ),
    "host_capacity_bytes": Option(
        "KVCACHED_HOST_CAPACITY_BYTES", None, _parse_positive_size,
        "Physical memory the host backend may create (unset: half of the machine's or cgroup's memory).",
    ),
    "host_memory": Option(
        "KVCACHED_HOST_MEMORY", "shared_files", _one_of(HOST_MEMORY_KINDS),
        "What host backend allocations are: shared_files (memfd files mapped shared, faulted in by first "
        "use), anonymous (4 KiB pages allocated at create) or huge_pages (2 MiB pages allocated at create).",
    ),
    "host_populate": Option(
        "KVCACHED_HOST_POPULATE", "background", _one_of(HOST_POPULATE_WAYS),
        "When shared_files host pages are allocated: background (as soon as they are mapped, on a thread of "
        "their own on CPUs the mapping thread is not bound to; if it is bound to none, as on_touch) or "
        "on_touch (by the first write's page faults).",
    ),
    "registry_dir": Option(
        "KVCACHED_REGISTRY_DIR", "/dev/shm", _parse_directory,
        "Directory of the per-device registry files (created with the registry's mode if missing).",
    ),
    "registry_group": Option(
        "KVCACHED_REGISTRY_GROUP", None, _parse_text,
        "Group (name or gid) that shares the registries; unset: private to the creating user.",
    ),
    "enable": Option(
        "KVCACHED_ENABLE", False, _parse_bool,
        "Switch kvcached on in a vLLM or SGLang engine (ENABLE_KVCACHED=true works too).",
        aliases=("ENABLE_KVCACHED",),
    ),
    "name": Option(
        "KVCACHED_NAME", None, _parse_instance_name,
        "An engine's name in the device registry (kvctl, kvtop); unset: derived from the model.",
    ),
    "limit_bytes": Option(
        "KVCACHED_LIMIT_BYTES", None, _parse_size,
        "An engine's own limit on physical KV memory; unset: vLLM's kv_cache_memory_bytes, else none.",
    ),
    "idle_cache_bytes": Option(
        "KVCACHED_IDLE_CACHE_BYTES", 0, _parse_size,
        "Prefix-cache memory an idle engine keeps (0: an engine with no requests returns all its KV memory).",
    ),
    "idle_release_s": Option(
        "KVCACHED_IDLE_RELEASE_S", 5.0, _parse_seconds_or_zero,
        "Seconds an idle engine keeps its KV memory before giving it back (a hold that ran out just before "
        "work came back grows, see KVCACHED_IDLE_RELEASE_MAX_S); at once when another instance on the device "
        "is refused memory or the engine is over its limit (0: as soon as idle).",
    ),
    "idle_release_max_s": Option(
        "KVCACHED_IDLE_RELEASE_MAX_S", 30.0, _parse_seconds_or_zero,
        "The longest an idle engine's hold grows to when its work came back soon after it gave its memory "
        "back: the next hold covers 1.5 times such an idle spell (at most KVCACHED_IDLE_RELEASE_S: a fixed hold).",
    ),
    "keep_freed_while_busy": Option(
        "KVCACHED_KEEP_FREED_WHILE_BUSY", True, _parse_bool,
        "SGLang: pages an engine frees (a flushed cache, aborted requests) stay mapped for its next requests; "
        "they go back with the rest at the end of its idle hold, at once when another instance waits for "
        "memory, or over its limit. Off: beyond KVCACHED_MAX_RESERVE_PAGES they go back at the end of the step.",
    ),
    "host_heap_keep_bytes": Option(
        "KVCACHED_HOST_HEAP_KEEP_BYTES", 256 << 20, _parse_size,
        "SGLang on the CPU: freed heap memory the scheduler keeps for its next step instead of glibc trimming "
        "it and faulting it in again (glibc's trim threshold; 0: glibc's own behaviour).",
    ),
    "rank_ack_timeout_s": Option(
        "KVCACHED_RANK_ACK_TIMEOUT_S", 120.0, _parse_seconds,
        "A rank that acknowledges no page operations for this long is declared lost (its budget returns).",
    ),
}


def get(name: str) -> Optional[object]:
    """Current value of option ``name`` (environment variable, else default)."""
    return OPTIONS[name].get()


__all__ = ["OPTIONS", "Option", "get"]
