"""The engine plugins' one front door: version policy, patch-point checks, enable and install (no engine needed)."""

from __future__ import annotations

import logging
import sys
import types

import pytest

from kvcached.errors import KvcachedError
from kvcached.integration import sglang as sglang_plugin
from kvcached.integration import vllm as vllm_plugin
from kvcached.integration.common.front_door import (
    EnginePlugin,
    PatchPoint,
    PatchPointMoved,
    UnsupportedEngineVersion,
    VersionPolicy,
    verify_patch_points,
)

ENGINE = "kvcached_fake_engine"  # a module this test builds: an "engine" with names to patch


@pytest.fixture
def engine(monkeypatch):
    module = types.ModuleType(ENGINE)

    class Scheduler:
        def schedule(self, budget, *, throttle=False):
            return budget

        def shutdown(self):
            pass

    def allocate(config, device, layout):
        return config

    module.Scheduler, module.allocate, module.__version__ = Scheduler, allocate, "1.4.2"
    monkeypatch.setitem(sys.modules, ENGINE, module)
    return module


@pytest.fixture
def packages(monkeypatch, engine):
    """Two version packages of a fake integration: 1.4 fits the engine, 1.3 expects what moved since."""
    installed = []
    root = types.ModuleType("kvcached_fake_integration")
    root.__path__ = []
    fits = types.ModuleType("kvcached_fake_integration.v1_4")
    fits.PATCH_POINTS = (
        PatchPoint(ENGINE, "Scheduler.schedule", ("self", "budget")),
        PatchPoint(ENGINE, "Scheduler", members=("shutdown",)),
        PatchPoint(ENGINE, "allocate", ("config", "device", "layout"), exact=True),
    )
    fits.install = lambda settings: installed.append(settings)
    old = types.ModuleType("kvcached_fake_integration.v1_3")
    old.PATCH_POINTS = (
        PatchPoint(ENGINE, "Scheduler.step"),
        PatchPoint(ENGINE, "allocate", ("config", "device"), exact=True),
    )
    old.install = lambda settings: installed.append(settings)
    for module in (root, fits, old):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return installed


def _policy(releases=None):
    return VersionPolicy(
        engine="Fake", package="kvcached_fake_integration", releases=releases or {(1, 4): "v1_4"}, release_parts=2
    )


def test_every_refusal_is_a_kvcached_error():
    assert issubclass(UnsupportedEngineVersion, KvcachedError) and issubclass(PatchPointMoved, KvcachedError)
    assert issubclass(vllm_plugin.UnsupportedVLLMVersion, UnsupportedEngineVersion)
    assert issubclass(sglang_plugin.UnsupportedSGLangVersion, UnsupportedEngineVersion)


@pytest.mark.parametrize("version,release", [("0.32.1+cpu", (0, 32)), ("0.34.0", (0, 34)), ("0.35.0rc1", (0, 35))])
def test_a_vllm_release_is_its_major_and_minor(version, release):
    assert vllm_plugin.POLICY.release_of(version) == release


@pytest.mark.parametrize("version,release", [("0.5.23", (0, 5, 23)), ("0.5.23.post1", (0, 5, 23))])
def test_an_sglang_release_is_its_major_minor_and_patch(version, release):
    assert sglang_plugin.POLICY.release_of(version) == release


def test_one_policy_per_engine_names_every_supported_release():
    assert vllm_plugin.SUPPORTED_VERSIONS == "0.32.x, 0.33.x, 0.34.x"
    assert sglang_plugin.SUPPORTED_VERSIONS == "0.5.23"
    for version, package in [("0.32.0", "v0_32"), ("0.33.1", "v0_33"), ("0.34.0", "v0_34")]:
        assert vllm_plugin.POLICY.releases[vllm_plugin.POLICY.release_of(version)] == package


@pytest.mark.parametrize(
    "policy,version",
    [
        (vllm_plugin.POLICY, "0.31.2"),
        (vllm_plugin.POLICY, "0.35.0"),
        (vllm_plugin.POLICY, "dev"),
        (sglang_plugin.POLICY, "0.5.24"),
        (sglang_plugin.POLICY, "0.5"),
    ],
)
def test_other_releases_are_refused_naming_the_supported_ones(policy, version):
    with pytest.raises(policy.error, match=f"supported: {policy.supported}"):
        policy.package_for(version)


def test_patch_points_that_are_in_place_pass(engine):
    verify_patch_points(
        [
            PatchPoint(ENGINE, "Scheduler.schedule", ("self", "budget", "throttle")),
            PatchPoint(ENGINE, "allocate", ("config", "device", "layout"), exact=True),
        ],
        engine="Fake",
        version="1.4.2",
        package="v1_4",
    )


@pytest.mark.parametrize(
    "point,why",
    [
        (PatchPoint(ENGINE, "Scheduler.step"), "Scheduler.step is gone"),
        (PatchPoint(ENGINE, "Scheduler", members=("shutdown", "_preempt")), "lacks _preempt"),
        (PatchPoint(ENGINE, "Scheduler.schedule", ("self", "throttle", "budget")), "no longer takes"),
        (PatchPoint(ENGINE, "allocate", ("config", "device"), exact=True), "no longer takes"),
        (PatchPoint(ENGINE + "_moved", "allocate"), "is gone"),
        (
            PatchPoint(ENGINE + "_moved", "allocate", optional=True),
            "is gone",
        ),  # optional: may fail to import, not vanish
    ],
)
def test_a_patch_point_that_moved_fails_loudly_naming_it(engine, point, why):
    with pytest.raises(PatchPointMoved, match=why) as raised:
        verify_patch_points([point], engine="Fake", version="1.4.2", package="v1_4")
    assert "Fake 1.4.2" in str(raised.value) and "engine-versions.md" in str(raised.value)


def test_an_optional_part_whose_own_imports_fail_is_skipped(tmp_path, monkeypatch):
    (tmp_path / "kvcached_fake_needs_triton.py").write_text("import kvcached_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    optional = PatchPoint("kvcached_fake_needs_triton", "allocate", optional=True)
    assert optional.problem() is None
    assert "does not import" in PatchPoint("kvcached_fake_needs_triton", "allocate").problem()


def test_the_plugin_installs_the_releases_package_once_per_process(engine, packages, monkeypatch):
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    plugin = EnginePlugin(_policy(), lambda: engine.__version__, logging.getLogger("test.front_door"))
    plugin.register()
    plugin.register()
    assert len(packages) == 1 and next(iter(plugin.installed.values())).__name__.endswith("v1_4")


def test_nothing_is_installed_when_a_patch_point_moved_and_the_engine_runs_on(engine, packages, monkeypatch, caplog):
    monkeypatch.setenv("KVCACHED_ENABLE", "1")
    plugin = EnginePlugin(_policy({(1, 4): "v1_3"}), lambda: engine.__version__, logging.getLogger("test.fd"))
    with pytest.raises(PatchPointMoved, match="Scheduler.step is gone.*allocate"):
        plugin.install()
    with caplog.at_level(logging.ERROR, logger="test.fd"):
        plugin.register()  # never raises: the engine runs without kvcached
    assert packages == [] and plugin.installed == {}
    assert "kvcached is NOT active" in caplog.text and "Scheduler.step is gone" in caplog.text


def test_the_plugin_is_a_no_op_unless_enabled(engine, packages, monkeypatch):
    for name in ("KVCACHED_ENABLE", "ENABLE_KVCACHED"):
        monkeypatch.delenv(name, raising=False)
    plugin = EnginePlugin(_policy(), lambda: pytest.fail("the version is not even read"), logging.getLogger("x"))
    plugin.register()
    assert packages == [] and plugin.installed == {}


def test_both_engines_enter_through_the_same_front_door():
    assert isinstance(vllm_plugin._plugin, EnginePlugin) and isinstance(sglang_plugin._plugin, EnginePlugin)
    assert vllm_plugin.register.__code__ is not sglang_plugin.register.__code__  # each its own entry point
    assert vllm_plugin._plugin.policy is vllm_plugin.POLICY and sglang_plugin._plugin.policy is sglang_plugin.POLICY


def test_both_front_doors_name_the_same_operations_alike():
    verbs = {"register", "install", "module_for", "POLICY", "SUPPORTED_VERSIONS", "PatchPointMoved", "is_enabled"}
    for plugin in (vllm_plugin, sglang_plugin):
        assert verbs <= set(plugin.__all__), f"{plugin.__name__} lacks {verbs - set(plugin.__all__)}"
    with pytest.raises(vllm_plugin.UnsupportedVLLMVersion):
        vllm_plugin.module_for("0.31.0")
    with pytest.raises(sglang_plugin.UnsupportedSGLangVersion):
        sglang_plugin.module_for("0.5.22")
