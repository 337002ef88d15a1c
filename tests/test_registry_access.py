"""The registry's access-control model (docs/security.md): private by default, shared with one named group.

Tests that need a second user create one (useradd) and run as root only.
"""

from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvcached.errors import RegistryAccessError
from kvcached.registry import DeviceRegistry, registry_for
from registry_files import PAGE_BYTES

PEER, OUTSIDER, SHARED_GROUP = "kvcached-test-peer", "kvcached-test-outsider", "kvcached-test-share"
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a second user")


@pytest.fixture(autouse=True)
def isolated_registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    monkeypatch.delenv("KVCACHED_REGISTRY_GROUP", raising=False)
    return tmp_path


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_a_new_registry_is_private_to_its_creator_whatever_the_umask(umask):
    previous = os.umask(umask)
    try:
        registry = DeviceRegistry("cpu", PAGE_BYTES)
    finally:
        os.umask(previous)
    info = os.stat(registry.path)
    assert (info.st_mode & 0o777, info.st_uid) == (0o600, os.geteuid())


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o604])
def test_a_file_open_to_every_user_is_never_used(mode):
    registry = DeviceRegistry("cpu", 4 * PAGE_BYTES)
    os.chmod(registry.path, mode)
    with pytest.raises(RegistryAccessError, match=rf"{registry.path} is open to every user .*mode 0{mode:o}"):
        DeviceRegistry("cpu")


def test_a_group_shared_file_needs_the_group_setting():
    group_name = grp.getgrgid(os.getegid()).gr_name
    registry = DeviceRegistry("cpu", 4 * PAGE_BYTES)
    os.chmod(registry.path, 0o660)
    with pytest.raises(
        RegistryAccessError, match=f"shared with group .*set KVCACHED_REGISTRY_GROUP={group_name} to use it"
    ):
        DeviceRegistry("cpu")


def test_the_group_setting_creates_shared_files_and_refuses_private_ones(monkeypatch, isolated_registry_dir):
    group = grp.getgrgid(os.getegid())
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(isolated_registry_dir / "shared"))
    monkeypatch.setenv("KVCACHED_REGISTRY_GROUP", group.gr_name)
    registry = DeviceRegistry("cpu", 4 * PAGE_BYTES)
    file_info, dir_info = os.stat(registry.path), os.stat(isolated_registry_dir / "shared")
    assert (file_info.st_mode & 0o777, file_info.st_gid) == (0o660, group.gr_gid)
    assert (dir_info.st_mode & 0o777, dir_info.st_gid) == (0o770, group.gr_gid)
    os.chmod(registry.path, 0o600)
    with pytest.raises(
        RegistryAccessError, match=f"not shared with the group in KVCACHED_REGISTRY_GROUP={group.gr_name}"
    ):
        DeviceRegistry("cpu")


def test_an_unknown_group_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_GROUP", "no-such-group-kvcached")
    with pytest.raises(
        ValueError, match="KVCACHED_REGISTRY_GROUP='no-such-group-kvcached' is invalid: it names no group"
    ):
        DeviceRegistry("cpu", PAGE_BYTES)


@pytest.mark.parametrize(
    "mode, message",
    [
        (0o777, "writable by every user without the sticky bit"),
        (0o770, "writable by group .* without the sticky bit"),
    ],
)
def test_a_directory_where_others_could_swap_files_is_refused(isolated_registry_dir, mode, message):
    directory = isolated_registry_dir / "loose"
    directory.mkdir()
    directory.chmod(mode)
    os.environ["KVCACHED_REGISTRY_DIR"] = str(directory)  # restored by the fixture's monkeypatch
    with pytest.raises(RegistryAccessError, match=message):
        registry_for("cpu", total_bytes=PAGE_BYTES)
    directory.chmod(mode | 0o1000)  # the sticky bit: like /dev/shm and /tmp
    assert registry_for("cpu", total_bytes=PAGE_BYTES).budget_bytes == PAGE_BYTES


@pytest.mark.parametrize(
    "mode, message",
    [
        (0o777, r"directory .*/above above the registry directory .* writable by every user without the sticky bit"),
        (0o775, r"directory .*/above above the registry directory .* writable by group .* without the sticky bit"),
    ],
)
def test_a_parent_where_others_could_move_the_registry_directory_is_refused(isolated_registry_dir, mode, message):
    above = isolated_registry_dir / "above"
    (above / "mid").mkdir(parents=True)
    above.chmod(mode)
    os.environ["KVCACHED_REGISTRY_DIR"] = str(above / "mid" / "registry")  # restored by the fixture's monkeypatch
    with pytest.raises(RegistryAccessError, match=message):
        registry_for("cpu", total_bytes=PAGE_BYTES)
    assert not (above / "mid" / "registry").exists(), "refused before anything is created"
    above.chmod(mode | 0o1000)  # sticky, and ours: only an entry's owner may rename it
    assert registry_for("cpu", total_bytes=PAGE_BYTES).budget_bytes == PAGE_BYTES


def test_a_parent_reached_through_a_symbolic_link_is_checked_where_the_link_leads(isolated_registry_dir):
    loose = isolated_registry_dir / "loose"
    (loose / "registry").mkdir(parents=True)
    loose.chmod(0o777)
    (isolated_registry_dir / "tidy").symlink_to(loose)
    os.environ["KVCACHED_REGISTRY_DIR"] = str(isolated_registry_dir / "tidy" / "registry")
    with pytest.raises(RegistryAccessError, match=rf"directory {loose} above .* without the sticky bit"):
        registry_for("cpu", total_bytes=PAGE_BYTES)


# ---- a second user ---------------------------------------------------------------------------


def _ensure_account(name: str, groups: tuple[str, ...] = ()) -> pwd.struct_passwd:
    try:
        return pwd.getpwnam(name)
    except KeyError:
        extra = ["-G", ",".join(groups)] if groups else []
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", *extra, name],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(name)


@pytest.fixture(scope="module")
def accounts():
    """A group, a member of it and an outsider; created once, left for later runs."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a second user")
    try:
        grp.getgrnam(SHARED_GROUP)
    except KeyError:
        subprocess.run(["groupadd", "--system", SHARED_GROUP], check=True, capture_output=True)
    return {
        "peer": _ensure_account(PEER, (SHARED_GROUP,)),
        "outsider": _ensure_account(OUTSIDER),
        "group": grp.getgrnam(SHARED_GROUP),
    }


@pytest.fixture
def shared_dir():
    """A directory root owns and others may enter (not write): /tmp/pytest-of-root is 0700."""
    directory = Path(tempfile.mkdtemp(prefix="kvcached-access-", dir="/tmp"))
    directory.chmod(0o755)
    yield directory
    for path in directory.iterdir():
        path.unlink()
    directory.rmdir()


def run_as(account: pwd.struct_passwd, action, directory: Path, group: str | None = None) -> tuple[int, str, str]:
    """Runs ``action()`` in a forked child that becomes ``account`` (with its groups): (exit code, stdout, stderr).

    Forked rather than exec'd: this interpreter may live where the other user cannot read.
    """
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                # pytest replaced sys.stdout/err with its capture: write to the descriptors.
                sys.stdout, sys.stderr = open(1, "w", closefd=False), open(2, "w", closefd=False)
                os.environ["KVCACHED_REGISTRY_DIR"] = str(directory)
                os.environ.pop("KVCACHED_REGISTRY_GROUP", None)
                if group is not None:
                    os.environ["KVCACHED_REGISTRY_GROUP"] = group
                os.setgroups(os.getgrouplist(account.pw_name, account.pw_gid))
                os.setgid(account.pw_gid)
                os.setuid(account.pw_uid)
                code = action() or 0
            except BaseException as error:  # reported through stderr
                print(f"{type(error).__name__}: {error}", file=sys.stderr)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read(), err.read()


def kvctl_as(account, directory, *args, group=None) -> tuple[int, str, str]:
    from kvcached.cli.kvctl import main

    return run_as(account, lambda: main(list(args)), directory, group)


@as_root
def test_another_user_can_neither_read_nor_change_nor_damage_a_private_registry(accounts, shared_dir, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(shared_dir))
    registry = DeviceRegistry("cpu", 8 * PAGE_BYTES)
    engine = registry.register("root-engine")
    code, _, stderr = kvctl_as(accounts["peer"], shared_dir, "list")
    assert code == 1 and stderr.count("\n") == 1, stderr
    assert f"registry {registry.path}" in stderr and "private to root" in stderr
    assert "KVCACHED_REGISTRY_GROUP" in stderr
    for args in (["set-budget", "0"], ["set-limit", "root-engine", "0"], ["clean"]):
        assert kvctl_as(accounts["peer"], shared_dir, *args)[0] == 1, args

    def damage() -> None:
        attempts = (
            lambda: open(registry.path, "r+b"),
            lambda: os.truncate(registry.path, 0),
            lambda: os.unlink(registry.path),
            lambda: os.rename(registry.path, "/tmp/x"),
        )
        for attempt in attempts:
            try:
                attempt()
                print("done")
            except PermissionError:
                print("denied")

    code, stdout, stderr = run_as(accounts["peer"], damage, shared_dir)
    assert code == 0 and stdout.split() == ["denied"] * 4, stderr
    assert registry.budget_bytes == 8 * PAGE_BYTES and engine.max_bytes is None and engine.registered


@as_root
def test_a_group_shares_a_registry_with_its_members_only(accounts, shared_dir, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(shared_dir))
    monkeypatch.setenv("KVCACHED_REGISTRY_GROUP", SHARED_GROUP)
    registry = DeviceRegistry("cpu", 8 * PAGE_BYTES)
    engine = registry.register("root-engine")
    assert os.stat(registry.path).st_gid == accounts["group"].gr_gid
    code, _, stderr = kvctl_as(accounts["peer"], shared_dir, "set-limit", "root-engine", "4MiB", group=SHARED_GROUP)
    assert code == 0, stderr
    assert engine.max_bytes == 2 * PAGE_BYTES, "a member steers the shared registry"

    def join() -> None:
        budget = registry_for("cpu").register("peer-engine")
        print(budget.try_acquire(PAGE_BYTES), [entry["name"] for entry in registry_for("cpu").entries()])
        budget.release(PAGE_BYTES)

    code, stdout, stderr = run_as(accounts["peer"], join, shared_dir, group=SHARED_GROUP)
    assert code == 0 and "True ['root-engine', 'peer-engine']" in stdout, stderr
    code, _, stderr = kvctl_as(accounts["peer"], shared_dir, "list")
    assert code == 1 and f"set KVCACHED_REGISTRY_GROUP={SHARED_GROUP} to use it" in stderr
    code, _, stderr = kvctl_as(accounts["outsider"], shared_dir, "set-budget", "0", group=SHARED_GROUP)
    assert code == 1 and "you are not a member of it" in stderr, stderr
    assert registry.budget_bytes == 8 * PAGE_BYTES


@as_root
def test_a_parent_owned_by_another_user_is_refused_even_with_the_sticky_bit(accounts, shared_dir, monkeypatch):
    theirs = shared_dir / "theirs"
    theirs.mkdir()
    os.chown(theirs, accounts["outsider"].pw_uid, -1)
    theirs.chmod(0o1777)
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(theirs / "registry"))
    try:
        with pytest.raises(RegistryAccessError, match=rf"directory {theirs} above .*owner {OUTSIDER}.*could move"):
            DeviceRegistry("cpu", PAGE_BYTES)
    finally:
        shutil.rmtree(theirs)
