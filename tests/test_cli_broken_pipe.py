"""Every command-line tool ends quietly when the reader of its output goes away (``kvctl list --json
| head``): exit status 1 and nothing on stderr, never a BrokenPipeError traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcached.registry import registry_for

COMMANDS = [
    ("kvcached.kvctl", "list", "--json"),
    ("kvcached.kvctl", "list"),
    ("kvcached.kvctl", "files", "--json"),
    ("kvcached", "info", "--json"),
    ("kvcached", "info"),
    ("kvcached.kvtop", "--once"),
    ("kvcached.config_doc",),
]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_a_reader_that_went_away_ends_the_tool_quietly(command, tmp_path, monkeypatch):
    if command[0] == "kvcached.kvtop":
        pytest.importorskip("rich", reason="kvtop needs rich")
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    registry = registry_for("cpu", budget_bytes=64 << 20)
    held = registry.register("reader-test")  # something to list
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: `| head -0`
    try:
        done = subprocess.run(
            [sys.executable, "-m", *command], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120
        )
    finally:
        os.close(write_end)
        held.unregister()
    assert (done.returncode, done.stderr) == (1, "")
