"""``kvcached serve`` goes on when the device registry's file is removed under it: ``/metrics`` keeps
answering (and counts the error), an engine that crashes afterwards is still restarted, and the
registry is opened again with serve's budget. And requests for models not served are counted
apart from any served model, whatever its name."""

from __future__ import annotations

import os
import shutil
import signal

import pytest

pytest.importorskip("prometheus_client", reason="kvcached serve needs the serve extra: pip install '.[serve]'")
pytest.importorskip("httpx", reason="kvcached serve needs the serve extra: pip install '.[serve]'")

from kvcached.serve.config import parse_config  # noqa: E402
from kvcached.serve.memory import DeviceMemory  # noqa: E402
from kvcached.serve.metrics import ServeMetrics  # noqa: E402
from kvcached.serve.supervisor import EngineState  # noqa: E402
from test_serve_supervisor import make_supervisor, starts, wait_for  # noqa: E402

MiB = 1 << 20


@pytest.fixture
def memory(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path / "registry"))
    (tmp_path / "registry").mkdir()
    config = parse_config(
        {"device": "cpu", "budget": "64MiB", "models": [{"name": n, "engine": "vllm", "model": "/m"} for n in "ab"]}
    )
    return config, DeviceMemory(config)


def test_a_removed_registry_is_opened_again_with_serves_budget(memory):
    config, memory = memory
    held = memory.registry.register("a")
    assert held.try_acquire(4 * MiB)
    os.unlink(memory.registry.path)
    assert memory.usage()["a"].mapped_bytes == 0  # a fresh registry: the detached engine is not in it
    assert memory.errors == 1 and memory.budget_bytes == 64 * MiB and os.path.exists(memory.registry.path)
    assert memory.reclaim("a") == 0


def test_metrics_keep_answering_and_count_the_errors_when_the_registry_is_gone(memory, tmp_path):
    config, memory = memory
    metrics = ServeMetrics(list(config.models), memory)
    os.unlink(memory.registry.path)
    text = metrics.exposition()[0].decode()
    assert (
        "kvcached_serve_registry_errors_total 1.0" in text
        and 'kvcached_serve_model_mapped_bytes{model="a"} 0.0' in text
    )
    shutil.rmtree(tmp_path / "registry")
    (tmp_path / "registry").write_text("")  # a file where its directory was: it cannot be created again
    text = metrics.exposition()[0].decode()
    assert "kvcached_serve_registry_errors_total 3.0" in text  # usage and budget, each failed once more
    assert "kvcached_serve_model_mapped_bytes{" not in text  # unknown, not shown as 0
    assert 'kvcached_serve_model_min_bytes{model="a"} 0.0' in text  # what the config says still is
    assert "kvcached_serve_device_budget_bytes " not in text
    assert memory.reclaim("a") == 0  # never raises: a restart must not depend on it


def test_an_engine_that_crashes_after_the_registry_went_away_is_restarted(tmp_path, monkeypatch):
    supervisor = make_supervisor(tmp_path, monkeypatch)
    supervisor.start()
    try:
        assert supervisor.wait_ready(lambda: False) is None
        os.unlink(supervisor.engines["one"]._memory.registry.path)
        os.kill(supervisor.route("one").pid, signal.SIGKILL)
        wait_for(
            lambda: supervisor.route("one").state is EngineState.READY and len(starts(tmp_path, "one")) == 2,
            "the engine was not restarted",
        )
        assert supervisor.route("one").restarts == 1 and supervisor.route("two").state is EngineState.READY
    finally:
        supervisor.stop()


def test_a_model_named_like_the_old_unknown_label_keeps_its_own_series():
    config = parse_config({"device": "cpu", "models": [{"name": "_unknown", "engine": "vllm", "model": "/m"}]})
    metrics = ServeMetrics(list(config.models))
    metrics.request_done("_unknown", "/v1/completions", 200, 0.0)
    metrics.request_done("never-served", "/v1/completions", 404, 0.0, known=False)
    text = metrics.exposition()[0].decode()
    assert 'kvcached_serve_requests_total{endpoint="/v1/completions",model="_unknown",status="200"} 1.0' in text
    assert 'kvcached_serve_requests_total{endpoint="/v1/completions",model="",status="404"} 1.0' in text
    assert 'model="_unknown",status="404"' not in text
