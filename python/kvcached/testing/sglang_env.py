"""SGLang's Python runtime on a CPU, in this process and the ones it starts.

SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1``) imports a few ``sgl_kernel``
CPU ops and torchvision at module level; ``sglang_cpu/`` holds an import stub
and a torchvision shim for them (see the files there). Call :func:`use_sglang_cpu`
before the first ``import sglang``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SGLANG_CPU_DIR = Path(__file__).resolve().parent / "sglang_cpu"


def sglang_cpu_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with what SGLang's CPU engine needs."""
    env = dict(os.environ if base is None else base)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    paths = [str(SGLANG_CPU_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def use_sglang_cpu() -> None:
    """Prepares this process (and its children, through the environment) to import SGLang."""
    os.environ.update(sglang_cpu_env())
    if str(SGLANG_CPU_DIR) not in sys.path:
        sys.path.insert(0, str(SGLANG_CPU_DIR))
    import _tv_cpu_shim

    _tv_cpu_shim.install()


def require_sglang():
    """Skips the calling test module unless SGLang is installed; else prepares and imports it.

    Nothing is changed in a process without SGLang (the vLLM tests collect
    these modules too).
    """
    import importlib
    import importlib.util

    import pytest

    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (see .ci/install_sglang_cpu.sh)", allow_module_level=True)
    use_sglang_cpu()
    return importlib.import_module("sglang")
