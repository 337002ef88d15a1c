"""The shared registry's hot path: what one page costs in budget bookkeeping (try_acquire + release,
the lock-free hints) and what registering costs. Host only: the registry is host shared memory."""

from __future__ import annotations

import pytest

from kvcached.registry import DeviceRegistry

PAGE_BYTES = 2 << 20
BUDGET_BYTES = 1 << 40


@pytest.fixture
def budget(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    registry = DeviceRegistry("cpu", BUDGET_BYTES)
    with registry.register("bench") as handle:
        yield handle


def test_try_acquire_and_release_one_page(benchmark, budget):
    def take_and_give_back() -> None:
        budget.try_acquire(PAGE_BYTES)
        budget.release(PAGE_BYTES)

    benchmark(take_and_give_back)
    assert budget.mapped_bytes == 0


def test_available_bytes_hint(benchmark, budget):
    assert benchmark(lambda: budget.available_bytes) == BUDGET_BYTES


def test_register_and_unregister(benchmark, tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    registry = DeviceRegistry("cpu", BUDGET_BYTES)
    benchmark(lambda: registry.register("cycle").unregister())
    assert registry.entries() == []
