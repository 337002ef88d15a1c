"""Process groups: starting an engine in a group of its own and making sure the whole group is gone.

An engine's server starts more processes (vLLM's EngineCore and workers, SGLang's scheduler and
detokenizer); killed with -9, the server leaves them behind. Each engine therefore runs in its
own session, and stopping it means stopping its whole process group, waiting until no process of
the group is left (zombies do not count: they hold no memory and are their parent's to reap).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

logger = logging.getLogger(__name__)

_POLL_S = 0.05


def _group_of(stat: str) -> tuple[str, int]:
    # /proc/PID/stat: "pid (comm) state ppid pgrp ..."; comm may hold spaces and parentheses.
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[0], int(fields[2])


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, group = _group_of((entry / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        if group == pgid and state != "Z":
            members.append(int(entry.name))
    return members


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass


def wait_group_gone(pgid: int, timeout_s: float) -> bool:
    """Waits until group ``pgid`` has no live process; True if it got there within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(_POLL_S)
    return True


def stop_group(pgid: int, timeout_s: float, *, force: bool = False) -> None:
    """Stops every process of group ``pgid``: SIGTERM, then SIGKILL after ``timeout_s`` (at once with
    ``force``); returns once none is left, or logs the ones that would not die."""
    if not force:
        _signal_group(pgid, signal.SIGTERM)
        if wait_group_gone(pgid, timeout_s):
            return
        logger.warning("process group %d did not stop within %.0f s of SIGTERM; sending SIGKILL", pgid, timeout_s)
    _signal_group(pgid, signal.SIGKILL)
    if not wait_group_gone(pgid, 10.0):
        logger.error("processes %s of group %d survive SIGKILL", group_members(pgid), pgid)


__all__ = ["group_members", "stop_group", "wait_group_gone"]
