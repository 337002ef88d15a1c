"""Serve's view of the device registry: it sets the budget, refuses mins above it and names already
taken, and sums each model's entries."""

from __future__ import annotations

import pytest

from kvcached.errors import ServeConfigError
from kvcached.registry import DeviceRegistry
from kvcached.serve.config import parse_config
from kvcached.serve.memory import DeviceMemory

MiB = 1 << 20


@pytest.fixture(autouse=True)
def own_registry(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))


def config(budget=None, mins=("0", "0")) -> object:
    data = {
        "device": "cpu",
        "models": [{"name": n, "engine": "vllm", "model": "/m", "memory": {"min": m}} for n, m in zip("ab", mins)],
    }
    if budget:
        data["budget"] = budget
    return parse_config(data)


def test_the_config_budget_replaces_the_registry_budget():
    DeviceRegistry("cpu", 16 * MiB)
    assert DeviceMemory(config("64MiB")).registry.budget_bytes == 64 * MiB


def test_without_a_budget_the_mins_are_checked_against_the_registry_budget():
    DeviceRegistry("cpu", 16 * MiB)
    with pytest.raises(ServeConfigError, match=r"^device: the models' memory.min add up to 24.0 MiB, above the budget"):
        DeviceMemory(config(mins=("12MiB", "12MiB")))


def test_a_name_a_live_process_has_registered_is_refused():
    registry = DeviceRegistry("cpu", 16 * MiB)
    held = registry.register("b")
    with pytest.raises(ServeConfigError, match=r"'b' is already registered on cpu by process \d+"):
        DeviceMemory(config())
    held.unregister()


def test_usage_sums_a_models_entries():
    memory = DeviceMemory(config("64MiB"))
    ranks = [memory.registry.register("a", local_device=f"rank{i}-cpu") for i in range(2)]
    for rank in ranks:
        assert rank.try_acquire(4 * MiB)
    usage = memory.usage()
    assert (usage["a"].mapped_bytes, usage["a"].entries, usage["b"].mapped_bytes) == (8 * MiB, 2, 0)
    for rank in ranks:
        rank.release(4 * MiB)
        rank.unregister()
