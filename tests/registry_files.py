"""Test helpers that damage, fake or inspect registry files byte by byte."""

from __future__ import annotations

import os
import struct
import subprocess
from pathlib import Path

from kvcached import _core

PAGE_BYTES = 2 * 1024 * 1024
# Made-up physical identities, shaped like nvidia-smi's.
GPU_A = "cuda-GPU-0a1b2c3d-0000-4000-8000-00000000000a"
GPU_B = "cuda-GPU-0a1b2c3d-0000-4000-8000-00000000000b"
LAYOUT: dict[str, int] = dict(_core._REGISTRY_LAYOUT)


def entry_offset(slot: int, field: str) -> int:
    """Byte offset of ``entry.<field>`` of table slot ``slot`` in a current registry file."""
    return LAYOUT["entries"] + slot * LAYOUT["entry_bytes"] + LAYOUT[f"entry.{field}"]


def poke(path: str | Path, offset: int, data: bytes) -> None:
    """Writes ``data`` into the file at ``offset``, as a careless (or hostile) writer would."""
    with open(path, "r+b") as file:
        file.seek(offset)
        file.write(data)


def start_ticks(pid: int) -> int:
    """/proc/<pid>/stat field 22: what the registry records to tell a reused pid apart."""
    with open(f"/proc/{pid}/stat") as stat:
        return int(stat.read().rsplit(")", 1)[1].split()[19])


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


# Layout version 1, as kvcached wrote it before device identities: a 192-byte
# header (magic, version, capacity, layout bytes, 32-byte device name, mutex,
# counters) and 64 entries of 192 bytes (state, id, pid, start ticks, ..., name).
V1_MAGIC = 0x545347455243564B
V1_HEADER_BYTES = 192
V1_ENTRY_BYTES = 192
V1_CAPACITY = 64
V1_LAYOUT_BYTES = V1_HEADER_BYTES + V1_CAPACITY * V1_ENTRY_BYTES
V1_NAME_OFFSET = 80


def write_v1_registry(path: str | Path, device: str, entries: list[tuple[int, int, str]]) -> None:
    """An old-style registry file with active ``(pid, start_ticks, name)`` entries, mode 0644 as old versions made."""
    data = bytearray(V1_LAYOUT_BYTES)
    struct.pack_into("<QIIQ32s", data, 0, V1_MAGIC, 1, V1_CAPACITY, V1_LAYOUT_BYTES, device.encode())
    for slot, (pid, ticks, name) in enumerate(entries):
        base = V1_HEADER_BYTES + slot * V1_ENTRY_BYTES
        struct.pack_into("<QQqQ", data, base, 1, slot + 1, pid, ticks)
        data[base + V1_NAME_OFFSET : base + V1_NAME_OFFSET + len(name)] = name.encode()
    Path(path).write_bytes(bytes(data))
    os.chmod(path, 0o644)
