"""fork() and host KV memory: a child keeps none of its parent's pages, so none outlives the registry's count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork semantics of the Linux host backend")

# The parent: a registered per-layer pool (memfd files, the default, or anonymous memory) holding 64 MiB
# written through, then a child forked while the pool lives. The child reports what it sees and
# waits; the parent closes its pool (the registry then counts 0) and exits.
PARENT = textwrap.dedent(
    """
    import ctypes, json, os, sys
    import kvcached
    from kvcached import _core
    from kvcached.registry import registry_for

    MiB = 1 << 20
    pool = kvcached.KVPool(num_layers=4, block_bytes=256 << 10, num_blocks=512, page_bytes=2 * MiB,
                           layout="per_layer", device="cpu", background_worker=False, name="forking-parent")
    ids = pool.alloc(32)  # 64 MiB: 4 page ids (8 blocks each) of 4 layers x K and V x 2 MiB
    address = pool.space.base_address + pool.space.offset_of(0, 0, int(ids[0]))
    for block in ids:
        for layer in range(4):
            for buffer in range(2):
                ctypes.memset(pool.space.base_address + pool.space.offset_of(layer, buffer, int(block)), 7, 256 << 10)
    files = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:kvcached"):
                files.append(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except FileNotFoundError:
            pass  # the directory's own descriptor
    report_r, report_w = os.pipe()
    go_r, go_w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(go_w)
            seen = {"first_byte": ctypes.string_at(address, 1)[0]}
            try:
                pool.space.map_pages([pool.num_pages - 1])
                seen["map"] = "mapped"
            except Exception as exc:
                seen["map"] = f"{type(exc).__name__}: {exc}"
            os.write(report_w, json.dumps(seen).encode())
            os.read(go_r, 1)  # until the parent has gone
        finally:
            os._exit(0)
    seen = json.loads(os.read(report_r, 4096))
    before = [e["mapped_bytes"] for e in registry_for("cpu").entries() if e["name"] == "forking-parent"]
    pool.close()
    after = [e for e in registry_for("cpu").entries() if e["name"] == "forking-parent"]
    kv_range = [pool.space.base_address, pool.space.base_address + pool.space.size_bytes]
    print(json.dumps(dict(child=child, files=files, seen=seen, before=before, after=after, kv_range=kv_range)),
          flush=True)
    sys.stdin.read()  # the test closes stdin once done; the child then exits too
    """
)


def _memfd_inodes_held_by(pid: int) -> set[int]:
    """Inodes of the kvcached memfd files ``pid`` keeps alive, by a descriptor or a mapping."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:kvcached"):
            held.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/memfd:kvcached"):
                held.add(int(fields[4]))
    return held


def _resident_bytes_in(pid: int, start: int, end: int) -> int:
    """Memory ``pid`` has resident in [start, end) (its smaps' Rss of the mappings there)."""
    resident, inside = 0, False
    with open(f"/proc/{pid}/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low < end and high > start
            elif head == "Rss:" and inside:
                resident += int(line.split()[1]) * 1024
    return resident


@pytest.mark.parametrize("host_memory", ["shared_files", "anonymous"])
def test_a_forked_child_keeps_none_of_the_parents_host_memory(host_memory):
    env = dict(os.environ, KVCACHED_HOST_MEMORY=host_memory)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        report = json.loads(parent.stdout.readline())
        assert report["before"] == [64 << 20] and report["after"] == []  # the registry counts 0 now
        assert len(report["files"]) == (32 if host_memory == "shared_files" else 0)  # a memfd per allocation
        # The child reads zeros where the parent's pages were, and cannot map there.
        assert report["seen"]["first_byte"] == 0
        assert report["seen"]["map"].startswith(
            "BackendUnavailableError: host: create refused: this process is a child of fork()"
        )
        # Nothing in the child keeps the parent's files (so their memory) alive.
        held = _memfd_inodes_held_by(report["child"])
        assert not held & set(report["files"]), f"the child still holds {len(held)} of the parent's memory files"
        assert _resident_bytes_in(report["child"], *report["kv_range"]) == 0
    finally:
        parent.stdin.close()
        parent.wait(30)
