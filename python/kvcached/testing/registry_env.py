"""Pointing this process at a registry directory for a moment (tests and harnesses).

kvcached reads ``KVCACHED_REGISTRY_DIR`` when it opens a registry, so a harness that sets up or
reads another registry than its own (a budget shared by engines it starts, a ``kvcached serve``'s)
sets the variable for that call only and gives the process its own registry back afterwards. The
variable is the process's, so threads that do this take turns (a sampling thread beside the test's).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Union

__all__ = ["using_registry_dir", "make_shared_budget"]

_VARIABLE = "KVCACHED_REGISTRY_DIR"
_TURNS = threading.RLock()


@contextlib.contextmanager
def using_registry_dir(directory: Union[str, Path]) -> Iterator[Path]:
    """``KVCACHED_REGISTRY_DIR`` is ``directory`` inside the block, and what it was after it."""
    with _TURNS:
        previous = os.environ.get(_VARIABLE)
        os.environ[_VARIABLE] = str(directory)
        try:
            yield Path(directory)
        finally:
            if previous is None:
                os.environ.pop(_VARIABLE, None)
            else:
                os.environ[_VARIABLE] = previous


def make_shared_budget(directory: Path, total_bytes: int) -> Path:
    """Creates ``directory`` holding a host-memory registry of ``total_bytes`` for engines to share."""
    from kvcached.registry import registry_for

    directory.mkdir(parents=True, exist_ok=True)
    with using_registry_dir(directory):
        registry_for("cpu", total_bytes=total_bytes)
    return directory
