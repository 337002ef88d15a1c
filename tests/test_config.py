"""Configuration: every option is documented, and invalid values fail with a message naming the variable."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path

import pytest

from kvcached import config, config_doc
from kvcached.errors import ConfigurationError

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"


def test_every_option_is_documented_with_its_default():
    text = DOC.read_text()
    for name, option in config.OPTIONS.items():
        assert f"`{option.env}`" in text, f"{option.env} is missing from docs/configuration.md"
        assert f"`{name}`" in text, f"option {name} is missing from docs/configuration.md"


def test_the_doc_table_is_the_one_generated_from_the_options():
    """Names, variables, values, defaults and meanings: docs/configuration.md shows OPTIONS exactly."""
    assert config_doc.documented_table(DOC.read_text()) == config_doc.options_table(), (
        "run: python -m kvcached.config_doc --write docs/configuration.md"
    )
    assert config_doc.main(["--check", str(DOC)]) == 0


def test_the_doc_check_fails_when_a_default_differs(tmp_path, monkeypatch):
    monkeypatch.setitem(
        config.OPTIONS, "max_reserve_pages", dataclasses.replace(config.OPTIONS["max_reserve_pages"], default=5)
    )
    copy = tmp_path / "configuration.md"
    copy.write_text(DOC.read_text())
    assert config_doc.main(["--check", str(copy)]) == 1
    config_doc.main(["--write", str(copy)])
    assert "| `KVCACHED_MAX_RESERVE_PAGES` |" in copy.read_text() and config_doc.main(["--check", str(copy)]) == 0


@pytest.mark.parametrize("name", ["host_memory", "host_populate", "layout"])
def test_every_choice_is_in_the_doc(name):
    row = next(line for line in DOC.read_text().splitlines() if line.startswith(f"| `{name}` |"))
    *others, last = config.OPTIONS[name].parse.choices
    assert row.split(" | ")[2] == f"one of {', '.join(others)} or {last}"


def test_every_variable_the_package_reads_is_documented():
    """Any KVCACHED_* name in the library's source (Python and C++) is in the doc."""
    text = DOC.read_text()
    sources = [*(ROOT / "python").rglob("*.py"), *(ROOT / "cpp").rglob("*.[ch]pp")]
    named = set()
    for source in sources:
        named |= set(re.findall(r"\"(KVCACHED_[A-Z_]+)\"", source.read_text()))
    named |= {"KVCACHED_GPU_BACKENDS"}  # read by CMake
    undocumented = sorted(env for env in named if f"`{env}`" not in text)
    assert not undocumented, f"missing from docs/configuration.md: {undocumented}"


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
        ("virtual_capacity_bytes", "2GB", 2 * 10**9),
        ("max_bytes", "512MiB", 512 << 20),
        ("idle_cache_bytes", "0", 0),
        ("name", "llama-8b", "llama-8b"),
        ("registry_dir", "/run/kvcached", "/run/kvcached"),
        ("enable", "on", True),
        ("rank_ack_timeout_s", "2.5", 2.5),
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
        ("zero_frontier_pages", "-1"),
        ("gpu_utilization", "0"),
        ("gpu_utilization", "1.5"),
        ("virtual_capacity_bytes", "-1G"),
        ("virtual_capacity_bytes", "1e99"),
        ("gpu_utilization", "abc"),
        ("gpu_utilization", "nan"),
        ("max_bytes", "0.5"),
        ("host_capacity_bytes", "0"),
        ("name", "bad\x1bname"),
        ("registry_dir", "relative/dir"),
        ("rank_ack_timeout_s", "0"),
        ("rank_ack_timeout_s", "inf"),
        ("rank_ack_timeout_s", "soon"),
    ],
)
def test_invalid_values_raise_a_clear_value_error(monkeypatch, name, text):
    env = config.OPTIONS[name].env
    monkeypatch.setenv(env, text)
    with pytest.raises(ValueError, match=env) as info:
        config.get(name)
    assert repr(text) in str(info.value)
    assert isinstance(info.value, ConfigurationError)  # a KvcachedError that is also a ValueError


@pytest.mark.parametrize(
    "env, text",
    [("KVCACHED_HOST_MEMORY", "bogus"), ("KVCACHED_HOST_POPULATE", "eager"), ("KVCACHED_HOST_CAPACITY_BYTES", "12x")],
)
def test_a_bad_host_setting_is_one_clear_line_from_the_command_line(env, text):
    import subprocess
    import sys

    env_vars = dict(os.environ, **{env: text})
    info = subprocess.run([sys.executable, "-m", "kvcached", "info"], capture_output=True, text=True, env=env_vars)
    assert f"cpu: cannot be used: {env}={text!r}" in info.stdout  # the host shows why; the others are still listed
    demo = subprocess.run(
        [sys.executable, "-m", "kvcached", "demo"], capture_output=True, text=True, env=env_vars, timeout=120
    )
    assert demo.returncode == 1
    assert demo.stderr.splitlines()[-1].startswith(f"kvcached: error: {env}={text!r}")
    assert "Traceback" not in info.stderr + demo.stderr


def test_an_invalid_variable_stops_pool_creation(monkeypatch):
    kvcached = pytest.importorskip("kvcached")
    monkeypatch.setenv("KVCACHED_LAYOUT", "sideways")
    with pytest.raises(ValueError, match="KVCACHED_LAYOUT"):
        kvcached.KVPool(
            1,
            4096,
            num_blocks=4,
            page_bytes=16384,
            device=kvcached._core.open_host_device(1 << 20),
            background_worker=False,
        )


def test_a_missing_registry_dir_is_created_private(tmp_path, monkeypatch):
    from kvcached.registry import registry_for

    directory = tmp_path / "new-registry-dir"
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(directory))
    monkeypatch.delenv("KVCACHED_REGISTRY_GROUP", raising=False)
    registry = registry_for("cpu", total_bytes=1 << 20)
    assert directory.is_dir() and (directory.stat().st_mode & 0o777) == 0o700
    assert Path(registry.path).parent == directory


def test_a_registry_dir_whose_parent_is_missing_is_a_plain_error(tmp_path, monkeypatch):
    from kvcached.errors import RegistryNotFoundError
    from kvcached.registry import registry_for

    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path / "no" / "such" / "dir"))
    with pytest.raises(RegistryNotFoundError, match=r"KVCACHED_REGISTRY_DIR=.*parent .*/no/such does not exist"):
        registry_for("cpu", total_bytes=1 << 20)


def test_a_relative_registry_dir_is_refused(monkeypatch):
    from kvcached.registry import registry_for

    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", "relative/dir")
    with pytest.raises(ValueError, match="KVCACHED_REGISTRY_DIR='relative/dir' is invalid: must be an absolute path"):
        registry_for("cpu", total_bytes=1 << 20)


def test_an_older_name_is_honoured_when_the_option_is_unset(monkeypatch):
    monkeypatch.delenv("KVCACHED_ENABLE", raising=False)
    monkeypatch.setenv("ENABLE_KVCACHED", "true")
    assert config.get("enable") is True
    monkeypatch.setenv("KVCACHED_ENABLE", "0")
    assert config.get("enable") is False, "the current name wins"
    monkeypatch.delenv("KVCACHED_ENABLE")
    monkeypatch.setenv("ENABLE_KVCACHED", "perhaps")
    with pytest.raises(ValueError, match="ENABLE_KVCACHED='perhaps'"):
        config.get("enable")


# ---- the default layout, per device kind -----------------------------------------------------


def test_every_device_kind_defaults_to_the_contiguous_layout(monkeypatch):
    from kvcached.configured import default_layout
    from kvcached.layout import DEFAULT_LAYOUTS

    monkeypatch.delenv("KVCACHED_LAYOUT", raising=False)
    assert DEFAULT_LAYOUTS == {"cuda": "contiguous", "hip": "contiguous", "host": "contiguous"}
    assert [default_layout(kind) for kind in ("cuda", "hip", "host", None)] == ["contiguous"] * 4
    monkeypatch.setenv("KVCACHED_LAYOUT", "per_layer")
    assert [default_layout(kind) for kind in ("cuda", "hip", "host", None)] == ["per_layer"] * 4


def test_a_pool_gets_its_device_kinds_layout_unless_told(monkeypatch, host_device):
    import kvcached

    monkeypatch.delenv("KVCACHED_LAYOUT", raising=False)
    with kvcached.KVPool(2, 4096, num_blocks=16, page_bytes=16384, device=host_device, register=False) as pool:
        assert pool.layout == "contiguous"
    monkeypatch.setenv("KVCACHED_LAYOUT", "per_layer")
    with kvcached.KVPool(2, 4096, num_blocks=16, page_bytes=16384, device=host_device, register=False) as pool:
        assert pool.layout == "per_layer"
    with kvcached.KVPool(
        2, 4096, num_blocks=16, page_bytes=16384, device=host_device, register=False, layout="contiguous"
    ) as pool:
        assert pool.layout == "contiguous"  # an argument wins over the variable


def test_info_shows_the_layout_pools_get_and_why(monkeypatch, capsys):
    from kvcached.cli.main import collect_info, main

    monkeypatch.delenv("KVCACHED_LAYOUT", raising=False)
    host = next(b for b in collect_info()["backends"] if b["name"] == "host")
    assert (host["default_layout"], host["layout_source"]) == ("contiguous", "default for the device kind")
    monkeypatch.setenv("KVCACHED_LAYOUT", "per_layer")
    assert main(["info"]) == 0
    assert "pools default to the per_layer layout (KVCACHED_LAYOUT)" in capsys.readouterr().out
    host = next(b for b in collect_info()["backends"] if b["name"] == "host")
    assert (host["default_layout"], host["layout_source"]) == ("per_layer", "KVCACHED_LAYOUT")


def test_the_space_options_follow_the_configuration(monkeypatch):
    from kvcached.configured import space_options

    monkeypatch.setenv("KVCACHED_ZERO_FRONTIER_PAGES", "16")
    assert space_options().zero_frontier_pages == 16
    monkeypatch.delenv("KVCACHED_ZERO_FRONTIER_PAGES")
    assert space_options().zero_frontier_pages == 64
