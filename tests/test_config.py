"""Configuration: every option is documented, and invalid values fail with a message naming the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcached import config

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_every_option_is_documented_with_its_default():
    text = DOC.read_text()
    for name, option in config.OPTIONS.items():
        assert f"`{option.env}`" in text, f"{option.env} is missing from docs/configuration.md"
        assert f"`{name}`" in text, f"option {name} is missing from docs/configuration.md"


@pytest.mark.parametrize("env", ["KVCACHED_HOST_CAPACITY_BYTES", "KVCACHED_REGISTRY_DIR", "KVCACHED_GPU_BACKENDS"])
def test_variables_outside_the_table_are_documented_too(env):
    assert f"`{env}`" in DOC.read_text()


def test_defaults_apply_when_unset(monkeypatch):
    for option in config.OPTIONS.values():
        monkeypatch.delenv(option.env, raising=False)
    assert {name: config.get(name) for name in config.OPTIONS} == {
        name: option.default for name, option in config.OPTIONS.items()
    }


@pytest.mark.parametrize(
    "name, text, value",
    [
        ("page_bytes", "2M", 2 << 20),
        ("page_bytes", "64KiB", 64 << 10),
        ("page_bytes", "4096", 4096),
        ("layout", " Contiguous ", "contiguous"),
        ("zero_backing", "off", False),
        ("zero_backing", "YES", True),
        ("gpu_utilization", "0.5", 0.5),
        ("min_reserve_pages", "0", 0),
        ("virtual_capacity_bytes", "1.5G", 3 << 29),
    ],
)
def test_valid_values_parse(monkeypatch, name, text, value):
    monkeypatch.setenv(config.OPTIONS[name].env, text)
    assert config.get(name) == value


@pytest.mark.parametrize(
    "name, text",
    [
        ("page_bytes", "-1"),
        ("page_bytes", "lots"),
        ("layout", "diagonal"),
        ("zero_backing", "maybe"),
        ("zero_chunk_bytes", "1X"),
        ("min_reserve_pages", "-2"),
        ("max_spare_pages", "two"),
        ("gpu_utilization", "0"),
        ("gpu_utilization", "1.5"),
        ("virtual_capacity_bytes", "-1G"),
    ],
)
def test_invalid_values_raise_a_clear_value_error(monkeypatch, name, text):
    env = config.OPTIONS[name].env
    monkeypatch.setenv(env, text)
    with pytest.raises(ValueError, match=env) as info:
        config.get(name)
    assert repr(text) in str(info.value)


def test_an_invalid_variable_stops_pool_creation(monkeypatch):
    kvcached = pytest.importorskip("kvcached")
    monkeypatch.setenv("KVCACHED_LAYOUT", "sideways")
    with pytest.raises(ValueError, match="KVCACHED_LAYOUT"):
        kvcached.KVPool(1, 4096, num_blocks=4, page_bytes=16384, device=kvcached._core.open_host_device(1 << 20),
                        background_worker=False)
