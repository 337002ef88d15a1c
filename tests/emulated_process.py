"""Runs Python in a fresh process over the test-only driver emulation, with its own configuration.

The fake drivers (tests/emulation) read their configuration (number of GPUs,
visible-device masks, granularity, ROCm modes) once per process, so each
configuration gets a process of its own. The snippet prints one JSON line last;
that is what :func:`run_emulated` returns.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap
from typing import Any, Optional

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
# Where `cmake --preset all-release -DKVCACHED_BUILD_EMULATION=ON` puts the fakes.
DEFAULT_EMULATION_DIR = REPO / "build" / "all-release" / "tests" / "emulation"

# Variables of the emulation and of the drivers' masks; cleared so that each
# run sees exactly the configuration it asks for.
_CONFIGURATION = (
    "KVCACHED_EMULATED_",
    "KVCACHED_HIP_",
    "CUDA_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
)


def emulation_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("KVCACHED_EMULATION_DIR", DEFAULT_EMULATION_DIR))


def require_emulation(backend: str) -> pathlib.Path:
    """The folder holding the fake driver of ``backend``; skips when it is not built."""
    folder = emulation_dir() / backend
    if not any(folder.glob("lib*.so*")):
        pytest.skip(
            f"the {backend} driver emulation is not built ({folder}); build it with "
            "`cmake --preset all-release -DKVCACHED_BUILD_EMULATION=ON && cmake --build --preset all-release`"
        )
    return folder


def emulated_env(backend: str, env: Optional[dict[str, str]] = None) -> dict[str, str]:
    """The environment of a process over the ``backend`` emulation: this one's, without any
    emulation or mask setting, plus ``env``; tests/ is on its path. Skips when not built."""
    folder = require_emulation(backend)
    child_env = {k: v for k, v in os.environ.items() if not k.startswith(_CONFIGURATION)}
    child_env.update(
        LD_LIBRARY_PATH=str(folder),
        KVCACHED_EMULATED_GPU="1",
        PYTHONPATH=str(REPO / "tests") + os.pathsep + child_env.get("PYTHONPATH", ""),
    )
    child_env.update(env or {})
    return child_env


def run_emulated(backend: str, code: str, env: Optional[dict[str, str]] = None, timeout: float = 120) -> Any:
    """Runs ``code`` over the ``backend`` emulation; returns the JSON of its last output line.

    Raises AssertionError with the process's output when it fails.
    """
    child_env = emulated_env(backend, env)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if result.returncode != 0:
        raise AssertionError(
            f"emulated {backend} process failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return json.loads(result.stdout.strip().splitlines()[-1])
