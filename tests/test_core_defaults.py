"""The core is given its defaults (kvcached.defaults): it reads what is installed, never the options or
the registry itself; ``import kvcached`` installs the configured ones."""

from __future__ import annotations

import pytest

import kvcached
from kvcached import _core, configured, defaults
from kvcached.errors import ConfigurationError
from kvcached.registry import registry_for

PAGE_BYTES = 64 << 10


class Recorded(configured.ConfiguredDefaults):
    """The configured defaults, but a layout of its own and pools charged on one fixed budget."""

    def __init__(self) -> None:
        self.budget = _core.FixedBudget(64 * PAGE_BYTES)
        self.asked: list[tuple[str, str]] = []
        super().__init__(pool_budget=self._fixed)

    def _fixed(self, device_name: str, pool_name: str) -> _core.MemoryBudget:
        self.asked.append((device_name, pool_name))
        return self.budget

    @staticmethod
    def layout_kind() -> str:
        return "per_layer"


@pytest.fixture
def recorded(monkeypatch):
    installed = Recorded()
    monkeypatch.setattr(defaults, "_installed", installed)
    return installed


def test_the_package_installs_the_configured_defaults():
    assert isinstance(defaults.current(), configured.ConfiguredDefaults)


def test_without_defaults_the_core_says_what_to_import(monkeypatch):
    monkeypatch.setattr(defaults, "_installed", None)
    with pytest.raises(ConfigurationError, match="import kvcached"):
        kvcached.KVLayout.from_config(2, 4096, 16, page_bytes=PAGE_BYTES)


def test_a_pool_takes_what_is_installed_not_the_variables(recorded, monkeypatch, host_device):
    monkeypatch.setenv("KVCACHED_LAYOUT", "contiguous")  # nobody below the installed defaults reads it
    before = [entry["name"] for entry in registry_for("cpu").entries()]
    with kvcached.KVPool(2, 4096, num_blocks=64, page_bytes=PAGE_BYTES, device=host_device, name="given") as pool:
        assert pool.layout == "per_layer"
        assert recorded.asked == [("cpu", "given")]
        assert pool.alloc(1).size == 1 and recorded.budget.available_bytes < 64 * PAGE_BYTES
        assert [entry["name"] for entry in registry_for("cpu").entries()] == before, "registered nowhere"
