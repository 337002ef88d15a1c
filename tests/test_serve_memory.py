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


def test_the_budget_serve_set_is_put_back_when_it_stops():
    DeviceRegistry("cpu", 16 * MiB)
    memory = DeviceMemory(config("64MiB"))
    assert memory.registry.budget_bytes == 64 * MiB
    memory.restore_budget()
    assert memory.registry.budget_bytes == 16 * MiB


def test_a_registry_serve_created_gets_the_budget_a_new_one_would_have():
    from kvcached.registry import default_budget_bytes, open_existing

    assert open_existing("cpu") is None
    memory = DeviceMemory(config("64MiB"))
    memory.restore_budget()
    assert memory.registry.budget_bytes == default_budget_bytes("cpu") != 64 * MiB


def test_a_budget_changed_while_serve_ran_stays():
    DeviceRegistry("cpu", 16 * MiB)
    memory = DeviceMemory(config("64MiB"))
    memory.registry.budget_bytes = 48 * MiB  # kvctl set-budget meanwhile
    memory.restore_budget()
    assert memory.registry.budget_bytes == 48 * MiB


def test_a_refused_start_leaves_the_budget_as_it_was():
    registry = DeviceRegistry("cpu", 16 * MiB)
    held = registry.register("b")
    with pytest.raises(ServeConfigError, match="already registered"):
        DeviceMemory(config("64MiB"))
    assert registry.budget_bytes == 16 * MiB
    held.unregister()


def test_without_a_budget_in_the_config_serve_changes_nothing():
    registry = DeviceRegistry("cpu", 16 * MiB)
    memory = DeviceMemory(config())
    registry.budget_bytes = 20 * MiB
    memory.restore_budget()
    assert registry.budget_bytes == 20 * MiB
