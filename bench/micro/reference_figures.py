"""Targets and reference figures the benchmarks are compared with: kvcached's own targets and the
H200 driver floor and reference-implementation figures they are judged against.

Every figure is in microseconds and was measured on one NVIDIA H200 (driver 580,
CUDA 13, 2 MiB pages), except where the note says otherwise. Targets apply to GPU
runs; host runs are reported next to them for information only.

Keys are the ``metric`` a benchmark stores in ``extra_info``; the figure is
compared with the benchmark's median time per operation (the median divided by
``extra_info["ops_per_call"]``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

MS = 1000.0  # microseconds per millisecond


@dataclasses.dataclass(frozen=True)
class Figure:
    target_us: Optional[float] = None  # our goal (at most this)
    reference_us: Optional[float] = None  # what the comparison point measured
    reference: str = ""  # what that comparison point is


DRIVER = "CUDA driver floor, C, per call"
REF = "reference implementation, H200"

FIGURES: dict[str, Figure] = {
    # ---- VMM contract: per 2 MiB page, against the bare driver call --------------------
    "vmm.reserve_64GiB": Figure(reference_us=2.5, reference=DRIVER),
    "vmm.create": Figure(reference_us=13, reference=DRIVER),
    "vmm.map": Figure(reference_us=1.1, reference=DRIVER),
    "vmm.set_access": Figure(reference_us=29, reference=DRIVER + " (27-31)"),
    "vmm.unmap": Figure(reference_us=17, reference=DRIVER),
    "vmm.release": Figure(reference_us=11, reference=DRIVER),
    # create + map + set_access of one allocation: about the same for 2 and 64 MiB.
    "vmm.grow_alloc_2MiB": Figure(reference_us=36, reference=DRIVER + " (13+1.1+29, rounded)"),
    "vmm.grow_alloc_64MiB": Figure(reference_us=36, reference="H200, one 64 MiB allocation (driver floor measurement)"),
    # ---- KV pools: 32 layers, K+V, 128 GiB virtual ------------------------------------
    "pool.setup_reserve.contiguous": Figure(target_us=5 * MS),
    "pool.setup_reserve.per_layer": Figure(target_us=5 * MS),
    "pool.setup_zero.contiguous": Figure(target_us=30 * MS, reference_us=42.6 * MS, reference=REF),
    "pool.setup_zero.per_layer": Figure(target_us=110 * MS, reference_us=2251 * MS, reference=REF),
    "pool.grow_cold.contiguous.ahead": Figure(target_us=76, reference_us=76, reference=REF),
    "pool.grow_cold.per_layer.ahead": Figure(target_us=4163, reference_us=4163, reference=REF),
    "pool.grow_cold.contiguous.on_grow": Figure(target_us=76, reference_us=76, reference=REF),
    "pool.grow_cold.per_layer.on_grow": Figure(target_us=4163, reference_us=4163, reference=REF),
    "pool.grow_warm.contiguous.zero_backed": Figure(target_us=40, reference_us=76, reference=REF + " (cold grow)"),
    "pool.grow_warm.per_layer.zero_backed": Figure(
        target_us=2.1 * MS, reference_us=4163, reference=REF + " (cold grow)"
    ),
    "pool.grow_warm.contiguous.no_zero_backing": Figure(target_us=40, reference_us=76, reference=REF + " (cold grow)"),
    "pool.grow_warm.per_layer.no_zero_backing": Figure(
        target_us=2.1 * MS, reference_us=4163, reference=REF + " (cold grow)"
    ),
    "pool.shrink.contiguous": Figure(target_us=90, reference_us=181, reference=REF),
    "pool.shrink.per_layer": Figure(reference_us=3876, reference=REF),
    "pool.grow64.contiguous": Figure(reference_us=5.6 * MS, reference=REF),
    "pool.grow64.per_layer": Figure(reference_us=231 * MS, reference=REF),
    "pool.alloc16_free": Figure(target_us=2, reference_us=24, reference="reference implementation, GB10"),
    "pool.available": Figure(target_us=0.3),
    "manager.alloc16_free": Figure(target_us=3, reference="target: <= 1.5x pool.alloc16_free in the same run"),
    # ---- decode-like trace (custom results, not pytest-benchmark) -----------------------
    "trace.alloc_p99": Figure(target_us=10),
    "trace.idle_to_min_reserve": Figure(target_us=1000 * MS),
}


def figure(metric: str) -> Figure:
    """The figure for ``metric``, or an empty one when there is nothing to compare with."""
    return FIGURES.get(metric, Figure())
