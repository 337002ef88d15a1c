"""Whether a serve config's models can run within a device budget: the check before anything starts.

Every model's min is guaranteed while it is awake; a sleeping model claims none. Models that never
sleep are awake together, so their mins must fit side by side; models that may sleep take turns, so
at the least the largest of them (its weights and its min) must fit beside those. The weights of a
model that never sleeps are not in the budget (its engine allocates them itself, outside kvcached);
a model that may sleep has its weights allocated through kvcached, so they count. A model given as
a hub id has no size until its engine has run: the check counts its min only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from kvcached.errors import ServeConfigError
from kvcached.serve.spec import ModelSpec
from kvcached.sizes import format_bytes

# Files that hold a checkpoint's weights (what an engine's weights take awake, before it ever ran).
_CHECKPOINT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def checkpoint_bytes(model: str) -> Optional[int]:
    """The size of the weight files of a model given as a local directory; None when it is not one
    (a hub id: the size is learnt once its engine has run)."""
    folder = Path(model).expanduser()
    if not folder.is_dir():
        return None
    sizes = [f.stat().st_size for f in folder.iterdir() if f.suffix in _CHECKPOINT_SUFFIXES and f.is_file()]
    return sum(sizes) if sizes else None


def awake_bytes(spec: ModelSpec) -> int:
    """What a model that may sleep takes of the budget awake, as known before it runs: its min, and
    its checkpoint's size where the model is a local directory."""
    return (checkpoint_bytes(spec.model) or 0) + spec.memory.min_bytes


def check_fit(models: tuple[ModelSpec, ...], budget_bytes: int, budget_key: str) -> None:
    """Raises ServeConfigError naming what cannot fit in ``budget_bytes`` (see the module docstring)."""
    never = [spec for spec in models if spec.sleep is None]
    never_mins = sum(spec.memory.min_bytes for spec in never)
    sleepers = [spec for spec in models if spec.sleep is not None]
    if not sleepers:
        if never_mins > budget_bytes:
            raise ServeConfigError(
                f"{budget_key}: the models' memory.min add up to {format_bytes(never_mins)}, above the budget of "
                f"{format_bytes(budget_bytes)}; lower some min or raise the budget"
            )
        return
    largest = max(sleepers, key=awake_bytes)
    need = awake_bytes(largest)
    if never_mins + need > budget_bytes:
        beside = f" beside the mins of the models that never sleep ({format_bytes(never_mins)})" if never else ""
        raise ServeConfigError(
            f"{budget_key}: the model {largest.name!r} needs {format_bytes(need)} awake (its checkpoint and its "
            f"memory.min){beside}: {format_bytes(never_mins + need)}, above the budget of {format_bytes(budget_bytes)}; "
            "raise the budget, lower some min, or let more models sleep"
        )


__all__ = ["awake_bytes", "check_fit", "checkpoint_bytes"]
