"""Processes that see the GPUs under a visible-devices mask of their own, for the multi-GPU tests.

A :class:`Machine` says how processes reach the GPUs (the real drivers, or the
test-only driver emulation) and which variable masks them; a :class:`Worker`
is one tests/rank_worker.py process under one mask, answering commands over a
pipe. Used by rank_scenario.py and landing_check.py.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

TESTS = Path(__file__).resolve().parent
REGISTRY_DIR_ENV = "KVCACHED_REGISTRY_DIR"
MASK_VARIABLES = {"cuda": "CUDA_VISIBLE_DEVICES", "hip": "HIP_VISIBLE_DEVICES"}
# Masks that would hide devices from an "unset" process, whatever this one was started with.
ALL_MASKS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
# A rank process imports torch and initialises its GPU: generous on a busy machine.
ANSWER_TIMEOUT_S = 180.0
TOOL_TIMEOUT_S = 60.0
# Wide enough that kvtop's table never elides a column.
TERMINAL_COLUMNS = "200"


@dataclasses.dataclass
class Machine:
    """How processes reach the GPUs: the backend, its visible-devices variable, and the
    environment every process starts from (the real drivers, or the emulation's)."""

    backend: str
    base_env: dict[str, str]
    _physical: Optional[list[str]] = dataclasses.field(default=None, repr=False)

    @classmethod
    def current(cls, backend: str = "cuda") -> Machine:
        """The GPUs as this process's environment reaches them: the real drivers, or the
        emulation when this process was started over it."""
        env = {k: v for k, v in os.environ.items() if k not in ALL_MASKS}
        env["PYTHONPATH"] = str(TESTS) + os.pathsep + env.get("PYTHONPATH", "")
        return cls(backend, env)

    @classmethod
    def emulated(cls, backend: str = "cuda", gpus: int = 2) -> Machine:
        from emulated_process import emulated_env

        return cls(backend, emulated_env(backend, {"KVCACHED_EMULATED_GPUS": str(gpus)}))

    @property
    def mask_variable(self) -> str:
        return MASK_VARIABLES[self.backend]

    def env(self, mask: Optional[str], registry_dir: Path) -> dict[str, str]:
        env = {**self.base_env, REGISTRY_DIR_ENV: str(registry_dir), "COLUMNS": TERMINAL_COLUMNS}
        if mask is not None:
            env[self.mask_variable] = mask
        return env

    def physical_identities(self) -> list[str]:
        """The identity of every GPU, in physical order (as a process without a mask sees them).
        Asked once, of a process with a registry directory of its own."""
        if self._physical is None:
            with tempfile.TemporaryDirectory(prefix="kvcached-probe-") as directory:
                probe = Worker(self, None, Path(directory))
                try:
                    self._physical = [device["identity"] for device in probe.call("identify", self.backend)["devices"]]
                finally:
                    probe.close()
        return list(self._physical)

    def tool(self, registry_dir: Path, module: str, *args: str, mask: Optional[str] = None) -> str:
        """Runs kvctl / kvtop as a user would; returns its output (fails the test on an error)."""
        done = subprocess.run(
            [sys.executable, "-m", f"kvcached.{module}", *args],
            env=self.env(mask, registry_dir),
            capture_output=True,
            text=True,
            timeout=TOOL_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise AssertionError(f"{module} {' '.join(args)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done.stdout


class Worker:
    """A rank_worker process under one visible-devices mask, answering over a pipe."""

    def __init__(self, machine: Machine, mask: Optional[str], registry_dir: Path) -> None:
        self.label = f"{machine.mask_variable}={'(unset)' if mask is None else mask}"
        self.closed = False
        ours, theirs = multiprocessing.Pipe()
        self.connection = ours
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rank_worker", str(theirs.fileno())],
            env=machine.env(mask, registry_dir),
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()

    def call(self, command: str, *args: Any) -> Any:
        try:
            self.connection.send((command, *args))
            if not self.connection.poll(ANSWER_TIMEOUT_S):
                raise AssertionError(
                    f"the process with {self.label} did not answer {command!r} in {ANSWER_TIMEOUT_S:.0f} s"
                )
            status, value = self.connection.recv()
        except (EOFError, BrokenPipeError):
            raise AssertionError(
                f"the process with {self.label} died during {command!r} (exit code {self.process.wait(30)})"
            ) from None
        if status != "ok":
            raise AssertionError(f"the process with {self.label} failed {command!r}: {value}")
        return value

    def close(self) -> dict[str, Any]:
        """Closes its space and entries; returns what the device still counts. Always reaps it
        (once: closing again returns {})."""
        if self.closed:
            return {}
        self.closed = True
        try:
            return self.call("close") if self.process.poll() is None else {}
        finally:
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
            self.connection.close()
