"""Old-style registries (layout version 1, GPUs named by index) and GPUs keyed two ways: never two silent budgets."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvcached.errors import RegistryUnusableError
from kvcached.registry import DeviceRegistry, registry_files
from registry_files import GPU_A, PAGE_BYTES, dead_pid, start_ticks, write_v1_registry

OLD_GPU_FILE = "kvcached-cuda:0"


@pytest.fixture(autouse=True)
def isolated_registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    monkeypatch.delenv("KVCACHED_REGISTRY_GROUP", raising=False)
    return tmp_path


def live_entry(name: str = "old-engine") -> tuple[int, int, str]:
    return os.getpid(), start_ticks(os.getpid()), name


def dead_entry(name: str = "old-engine") -> tuple[int, int, str]:
    return dead_pid(), 12345, name


def kvctl(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "kvcached.kvctl", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_an_old_host_registry_in_use_is_refused_naming_its_users(isolated_registry_dir):
    path = isolated_registry_dir / "kvcached-cpu"
    write_v1_registry(path, "cpu", [live_entry()])
    before = path.read_bytes()
    with pytest.raises(
        RegistryUnusableError, match=rf"{path} was made by an older kvcached \(layout version 1.*pid {os.getpid()}"
    ):
        DeviceRegistry("cpu", 4 * PAGE_BYTES)
    assert path.read_bytes() == before, "left as it is for the old engines"


def test_an_old_host_registry_nobody_uses_is_replaced(isolated_registry_dir):
    path = isolated_registry_dir / "kvcached-cpu"
    write_v1_registry(path, "cpu", [dead_entry()])
    with pytest.raises(RegistryUnusableError, match="no live process uses it"):
        DeviceRegistry("cpu")  # opening only: reported, not replaced
    registry = DeviceRegistry("cpu", 4 * PAGE_BYTES)
    assert registry.budget_bytes == 4 * PAGE_BYTES and (path.stat().st_mode & 0o777) == 0o600


def test_a_gpu_engine_is_refused_while_an_old_index_registry_has_live_instances(isolated_registry_dir):
    write_v1_registry(isolated_registry_dir / OLD_GPU_FILE, "cuda:0", [live_entry()])
    registry = DeviceRegistry(GPU_A, 8 * PAGE_BYTES)
    with pytest.raises(
        RegistryUnusableError, match=rf"{OLD_GPU_FILE} keys a GPU by index, as older .* two independent budgets"
    ):
        registry.register("new-engine")
    assert registry.entries() == []
    DeviceRegistry("cpu", PAGE_BYTES).register("host-engine")  # the host is not a GPU: unaffected
    (old,) = [file for file in registry_files() if file["file_name"] == OLD_GPU_FILE]
    assert old["status"] == "old_style" and old["live_pids"] == [os.getpid()] and not old["removable"]
    assert kvctl("clean")["removed_files"] == [], "kvctl clean keeps a file still in use"


def test_an_old_index_registry_nobody_uses_is_removed_by_the_next_gpu_engine(isolated_registry_dir):
    write_v1_registry(isolated_registry_dir / OLD_GPU_FILE, "cuda:0", [dead_entry()])
    with DeviceRegistry(GPU_A, 8 * PAGE_BYTES).register("new-engine") as budget:
        assert budget.try_acquire(PAGE_BYTES)
    assert not (isolated_registry_dir / OLD_GPU_FILE).exists()


def test_kvctl_clean_removes_unused_old_damaged_and_unfinished_files(isolated_registry_dir):
    write_v1_registry(isolated_registry_dir / "kvcached-rocm:1", "rocm:1", [dead_entry()])
    (isolated_registry_dir / "kvcached-cuda-index-2").write_bytes(b"")
    (isolated_registry_dir / "kvcached-cuda-index-2").chmod(0o600)
    unfinished = f"kvcached-cpu.init.{dead_pid()}.7"
    (isolated_registry_dir / unfinished).write_bytes(b"half")
    (isolated_registry_dir / "kvcached-foreign").write_bytes(b"not ours at all")
    removed = sorted(os.path.basename(path) for path in kvctl("clean")["removed_files"])
    assert removed == sorted(["kvcached-rocm:1", "kvcached-cuda-index-2", unfinished])
    assert sorted(os.listdir(isolated_registry_dir)) == ["kvcached-foreign"], "foreign files are left alone"
    listing = kvctl("files")["files"]
    assert [(file["file_name"], file["status"]) for file in listing] == [("kvcached-foreign", "foreign")]


@pytest.mark.parametrize("first, second", [("cuda-index-0", GPU_A), (GPU_A, "cuda-index-0")])
def test_gpus_keyed_by_identity_and_by_index_never_share_a_directory_live(first, second):
    holder = DeviceRegistry(first, 8 * PAGE_BYTES).register("first")
    with pytest.raises(RegistryUnusableError, match=f"kvcached-{first} keys a GPU .* used by pid {os.getpid()}"):
        DeviceRegistry(second, 8 * PAGE_BYTES).register("second")
    holder.unregister()
    with DeviceRegistry(second, 8 * PAGE_BYTES).register("second") as budget:
        assert budget.registered, "once nobody uses the other keying, registering works"


@pytest.mark.parametrize("older", [2, 3], ids=["before-the-memory-policy", "before-model-weights"])
def test_a_registry_of_an_older_layout_version_is_refused_and_left_alone(isolated_registry_dir, older):
    from kvcached._core import _REGISTRY_LAYOUT

    path = isolated_registry_dir / "kvcached-cpu"
    DeviceRegistry("cpu", 4 * PAGE_BYTES)  # a current file, then its version turned back
    with open(path, "r+b") as file:
        file.seek(_REGISTRY_LAYOUT["header.version"])
        file.write(older.to_bytes(4, "little"))
    before = path.read_bytes()
    with pytest.raises(RegistryUnusableError, match=rf"has layout version {older} \(this kvcached reads 4\)"):
        DeviceRegistry("cpu", 4 * PAGE_BYTES)
    assert [file["status"] for file in registry_files()] == ["other_version"]
    assert path.read_bytes() == before, "never rewritten under engines of the other version"
