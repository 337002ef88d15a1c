"""Driver-call accounting: which CUDA VMM calls an operation makes, and how long the driver took.

Builds and reads ``bench/reference/call_counter/cuda_call_counter.c``, an ``LD_PRELOAD`` shim
that sits between a process and ``libcuda.so.1`` (the real driver, or the test-only
emulation in ``tests/emulation``) and records every VMM call. A benchmark that runs
with the shim preloaded brackets each operation with :meth:`CallRecorder.mark` /
:meth:`CallRecorder.since` and gets, per operation, how many creates, maps,
set_access, unmaps and releases it made, which of them touched a zero allocation
(zero backing), and the time spent inside the driver.

    python bench/reference/driver_calls.py --build DIR     # compile the shim, print its path
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path
from typing import Optional

SHIM_SOURCE = Path(__file__).resolve().parent / "call_counter" / "cuda_call_counter.c"
SHIM_NAME = "libcuda_call_counter.so"

#: Call kinds in the shim's order (its enum).
CALLS = (
    "reserve",
    "free_range",
    "create",
    "release",
    "map",
    "unmap",
    "set_access",
    "memset",
    "synchronize",
    "mem_get_info",
    "ctx_get_current",
    "ctx_set_current",
)
#: The calls a VMM floor is made of (bench_vmm measures these).
FLOOR_CALLS = ("create", "map", "set_access", "unmap", "release")


class Event(ctypes.Structure):
    """One driver call, as the shim records it (``struct ccount_event``)."""

    _fields_ = [
        ("call", ctypes.c_uint32),
        ("zero", ctypes.c_uint32),
        ("bytes", ctypes.c_uint64),
        ("mappings", ctypes.c_uint64),
        ("handle", ctypes.c_uint64),
        ("driver_ns", ctypes.c_uint64),
    ]


def build_shim(out_dir: os.PathLike | str, compiler: Optional[str] = None) -> Path:
    """Compiles the shim into ``out_dir`` (once) and returns its absolute path."""
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = out / SHIM_NAME
    if target.exists() and target.stat().st_mtime >= SHIM_SOURCE.stat().st_mtime:
        return target
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found to build the driver-call counter (set CC)")
    subprocess.run(
        [cc, "-O2", "-Wall", "-shared", "-fPIC", "-o", str(target), str(SHIM_SOURCE), "-ldl", "-lpthread"],
        check=True,
    )
    return target


def preload_env(env: dict, shim: Optional[os.PathLike | str], *also: str) -> dict:
    """``env`` with ``LD_PRELOAD`` naming ``also`` (e.g. a libstdc++) and the shim."""
    libraries = [str(x) for x in also if x] + ([str(Path(shim).resolve())] if shim else [])
    if not libraries:
        return env
    existing = env.get("LD_PRELOAD", "")
    return dict(env, LD_PRELOAD=":".join(filter(None, [existing, *libraries])))


class CallRecorder:
    """Reads the shim loaded in this process (see :meth:`attach`)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._lib = library
        self._lib.ccount_event_count.restype = ctypes.c_size_t
        self._lib.ccount_copy_events.restype = ctypes.c_size_t
        self._lib.ccount_copy_events.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(Event)]
        self._lib.ccount_event_size.restype = ctypes.c_size_t
        if self._lib.ccount_event_size() != ctypes.sizeof(Event):
            raise RuntimeError("the driver-call counter was built from another version of the shim")

    @classmethod
    def attach(cls) -> Optional[CallRecorder]:
        """The recorder when the shim is preloaded into this process, else None."""
        try:
            library = ctypes.CDLL(None)
            library.ccount_event_count  # noqa: B018 - raises AttributeError when absent
        except (OSError, AttributeError):
            return None
        return cls(library)

    def mark(self) -> int:
        """Position to pass to :meth:`since`."""
        return int(self._lib.ccount_event_count())

    def since(self, mark: int) -> list[Event]:
        """Every call recorded after ``mark``."""
        count = self.mark() - mark
        if count <= 0:
            return []
        events = (Event * count)()
        copied = self._lib.ccount_copy_events(mark, count, events)
        return list(events[:copied])


def summarize(events: list[Event], operations: int = 1) -> dict:
    """Calls per operation: ``{"create": 1.0, "unmap_zero": 1.0, ..., "driver_us": 45.1}``.

    A key is the call's name, with ``_zero`` when it touched a zero allocation;
    ``driver_us`` is the time inside the driver; ``<call>_us`` its share by call;
    ``unmap_mappings`` / ``set_access_mappings`` how many mappings the range calls spanned.
    Everything is divided by ``operations`` (events of several identical operations).
    """
    counts: Counter = Counter()
    driver_ns: Counter = Counter()
    spans: Counter = Counter()
    sizes: dict[str, set] = {}
    for event in events:
        name = CALLS[event.call] + ("_zero" if event.zero else "")
        counts[name] += 1
        driver_ns[name] += event.driver_ns
        if CALLS[event.call] in ("unmap", "set_access"):
            spans[name + "_mappings"] += event.mappings
        if event.bytes:
            sizes.setdefault(name, set()).add(int(event.bytes))
    per_op = max(operations, 1)
    summary: dict = {name: round(n / per_op, 3) for name, n in sorted(counts.items())}
    summary.update({name: round(n / per_op, 3) for name, n in sorted(spans.items())})
    summary.update({f"{name}_us": round(ns / per_op / 1e3, 2) for name, ns in sorted(driver_ns.items())})
    summary["driver_us"] = round(sum(driver_ns.values()) / per_op / 1e3, 2)
    summary["sizes_bytes"] = {name: sorted(s) for name, s in sorted(sizes.items())}
    return summary


def call_counts(summary: dict) -> dict:
    """Only the call counts of a :func:`summarize` result (no times, spans or sizes)."""
    names = set(CALLS) | {c + "_zero" for c in CALLS}
    return {k: v for k, v in summary.items() if k in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", metavar="DIR", required=True, help="directory to compile the shim into")
    args = parser.parse_args()
    print(build_shim(args.build))


if __name__ == "__main__":
    main()
