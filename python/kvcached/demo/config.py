"""What a demo run depends on: its options (:class:`DemoConfig`, checked with the limits here) and
the sizes that follow from them on the device (:class:`Geometry`, measured by
:func:`kvcached.demo.run.measure_geometry`). The engine fleet and the runs both take them."""

from __future__ import annotations

import dataclasses
import math

from kvcached.errors import InvalidArgumentError

MIB = 1 << 20
# Small KV geometry: 2 layers x K,V x 64 KiB blocks make a block id 256 KiB and
# (with 2 MiB pages) a page id 8 MiB of 32 blocks, so a request spans 0.5-3
# pages, as a few thousand tokens do in a real engine; much smaller blocks let
# a few long requests pin many half-empty pages.
DEFAULT_NUM_LAYERS = 2
DEFAULT_NUM_BUFFERS = 2
DEFAULT_BLOCK_BYTES = 64 << 10
DEFAULT_ENGINES = 3
DEFAULT_DURATION_S = 15.0
# 30 page ids of 8 MiB: divides evenly among 2, 3, 5 or 6 engines, and the busy
# engine's peak (~60 % of it) is far above a third.
DEFAULT_BUDGET_BYTES = 240 * MIB
DEFAULT_WAIT_TIMEOUT_S = 1.0
# Each engine is a process with its own pool: more than this is a typo, not a demo.
MAX_ENGINES = 64
MAX_DURATION_S = 3600.0


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Everything a demo run depends on."""

    engines: int = DEFAULT_ENGINES
    duration_s: float = DEFAULT_DURATION_S
    seed: int = 0
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    device: str = "cpu"
    wait_timeout_s: float = DEFAULT_WAIT_TIMEOUT_S
    num_layers: int = DEFAULT_NUM_LAYERS
    num_buffers: int = DEFAULT_NUM_BUFFERS
    block_bytes: int = DEFAULT_BLOCK_BYTES

    def validate(self) -> None:
        """Raises ValueError, naming the option, on settings the demo cannot run with."""
        if not 1 <= self.engines <= MAX_ENGINES:
            raise InvalidArgumentError(f"--engines must be between 1 and {MAX_ENGINES}, got {self.engines}")
        if not (math.isfinite(self.duration_s) and 0 < self.duration_s <= MAX_DURATION_S):
            raise InvalidArgumentError(
                f"--duration must be a number of seconds in (0, {MAX_DURATION_S:g}], got {self.duration_s}"
            )
        if not (math.isfinite(self.wait_timeout_s) and 0 <= self.wait_timeout_s <= MAX_DURATION_S):
            raise InvalidArgumentError(
                f"--wait-timeout must be a number of seconds in [0, {MAX_DURATION_S:g}], got {self.wait_timeout_s}"
            )
        if not 0 <= self.seed < 2**63:
            raise InvalidArgumentError(f"--seed must be a non-negative integer below 2**63, got {self.seed}")
        if self.budget_bytes <= 0:
            raise InvalidArgumentError("--budget must be positive")


@dataclasses.dataclass
class Geometry:
    """Sizes that follow from the config and the device's page size."""

    block_id_bytes: int
    page_id_bytes: int
    blocks_per_page: int
    num_blocks: int
    budget_blocks: int
    static_limit_bytes: int


__all__ = [
    "DEFAULT_BLOCK_BYTES",
    "DEFAULT_BUDGET_BYTES",
    "DEFAULT_DURATION_S",
    "DEFAULT_ENGINES",
    "DEFAULT_NUM_BUFFERS",
    "DEFAULT_NUM_LAYERS",
    "DEFAULT_WAIT_TIMEOUT_S",
    "MAX_DURATION_S",
    "MAX_ENGINES",
    "DemoConfig",
    "Geometry",
]
