"""What the serve tests with real engines need, checked before they import anything of it."""

from __future__ import annotations

import os
from pathlib import Path

SERVE_TEST_MODULES = ("fastapi", "uvicorn", "httpx", "yaml", "prometheus_client", "openai")


def require_real_engines() -> str:
    """Skips the calling test module unless this Python has vLLM, the serve extra and ``openai``,
    and ``KVCACHED_SGLANG_PYTHON`` names an SGLang environment; returns that interpreter's path."""
    import pytest

    pytest.importorskip("vllm", reason="the serve tests run vLLM engines")
    for module in SERVE_TEST_MODULES:
        pytest.importorskip(module, reason="the serve tests need the serve extra and openai")
    sglang_python = os.environ.get("KVCACHED_SGLANG_PYTHON", "")
    if not Path(sglang_python).is_file():
        pytest.skip("KVCACHED_SGLANG_PYTHON names no SGLang environment (see .ci/run)", allow_module_level=True)
    return sglang_python
