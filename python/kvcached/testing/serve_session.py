"""One ``kvcached serve`` process for the serve tests and benchmarks: its config (from
``examples/serve-cpu.yaml``), its log, and the engines it started, as its log names them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Generic, Optional, TypeVar

import yaml

from kvcached.testing.registry_env import using_registry_dir

START_TIMEOUT_S = 600
_STARTED = re.compile(r"kvcached serve: (\S+): started (\w+) \(pid (\d+), port (\d+)")


def serve_config(
    example: Path, model_dir: Path, sglang_python: Optional[str], port: int, budget: str, models: dict[str, dict]
) -> dict:
    """``example`` (examples/serve-cpu.yaml) with this machine's tiny model, SGLang environment and
    port; ``models`` updates each model's keys (``env`` and ``memory`` are merged). With no
    ``sglang_python`` the SGLang models are left out."""
    config = yaml.safe_load(Path(example).read_text())
    config.update(listen=f"127.0.0.1:{port}", budget=budget)
    if sglang_python is None:
        config["models"] = [model for model in config["models"] if model["engine"] != "sglang"]
    for model in config["models"]:
        model["model"] = str(model_dir)
        if model["engine"] == "sglang":
            model["python"] = sglang_python
        extra = models.get(model["name"], {})
        model.setdefault("env", {}).update(extra.get("env", {}))
        model.setdefault("memory", {}).update(extra.get("memory", {}))
    return config


class ServeProcess:
    """``python -m kvcached serve CONFIG`` in its own session, with a private registry."""

    def __init__(self, workdir: Path, config: dict, registry_dir: Path) -> None:
        self.workdir = workdir
        self.config_path = workdir / "serve.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.port = int(config["listen"].rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / "serve.log"
        self.registry_dir = registry_dir
        self.env = {**os.environ, "KVCACHED_REGISTRY_DIR": str(registry_dir)}
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> None:
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvcached",
                    "serve",
                    str(self.config_path),
                    "--log-dir",
                    str(self.workdir / "logs"),
                ],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def engines(self) -> dict[str, dict[str, Any]]:
        """Each model's latest engine as the log names it: pid (= its process group) and port."""
        found: dict[str, dict[str, Any]] = {}
        for name, engine, pid, port in _STARTED.findall(self.log()):
            found[name] = {"engine": engine, "pid": int(pid), "port": int(port)}
        return found

    def all_pids(self) -> set[int]:
        """Every engine process group serve ever started."""
        return {int(pid) for _, _, pid, _ in _STARTED.findall(self.log())}

    def health(self) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())
        except OSError:
            return 0, {}

    def wait_healthy(self, timeout_s: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while self.health()[0] != 200:
            assert self.process.poll() is None, f"kvcached serve exited:\n{self.log()[-8000:]}"
            assert time.monotonic() < deadline, f"kvcached serve not healthy in {timeout_s} s:\n{self.log()[-8000:]}"
            time.sleep(1.0)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as answer:
            return answer.read().decode()

    def stop(self, timeout_s: float = 120) -> int:
        """SIGTERM, as a service manager stops it; its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            raise


def registry_entries(registry_dir: Path) -> list[dict]:
    """The entries of the cpu registry in ``registry_dir`` (as kvctl reads them)."""
    from kvcached.registry import open_existing

    with using_registry_dir(registry_dir):
        registry = open_existing("cpu")
        return registry.entries() if registry is not None else []


def metric_value(text: str, name: str, **labels: str) -> Optional[float]:
    """The value of one sample in Prometheus text, or None."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and line.split(" ")[0] != name:
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{key}="{want}"' in head for key, want in labels.items()):
            return float(value)
    return None


def metric_sum(text: str, name: str, **labels: str) -> float:
    """The sum of every sample of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head.split("{")[0] == name and all(f'{key}="{want}"' in head for key, want in labels.items()):
            total += float(value)
    return total


T = TypeVar("T")


class Sampler(Generic[T]):
    """Calls ``read()`` every ``interval_s`` on a thread of its own while a ``with`` block runs.

    ``samples`` holds ``(time.monotonic(), read())`` pairs, oldest first.
    """

    def __init__(self, read: Callable[[], T], interval_s: float = 0.01) -> None:
        self.read, self.interval_s = read, interval_s
        self.samples: list[tuple[float, T]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="serve-sampler", daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            self.samples.append((time.monotonic(), self.read()))
            time.sleep(self.interval_s)

    def __enter__(self) -> Sampler[T]:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
