"""A stand-in for an engine's OpenAI server, for the supervisor tests: ``python -m fake_engine_server``.

Takes the arguments ``kvcached serve`` gives an engine, registers in the device registry under
``KVCACHED_NAME`` with ``FAKE_ENGINE_MAPPED_BYTES`` taken from the budget (as an engine that
mapped its KV cache), starts a child in its process group that ignores SIGTERM (as a
stuck EngineCore would), writes what it
was given to ``FAKE_ENGINE_RECORD`` (one JSON line per start), and answers ``/health``.
``FAKE_ENGINE_FAIL=1``: exits at once with code 3 instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_STUBBORN_CHILD = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--model", "--served-model-name", "--host"):
        parser.add_argument(flag)
    parser.add_argument("--port", type=int)
    args, extra = parser.parse_known_args()
    if os.environ.get("FAKE_ENGINE_FAIL"):
        print("fake engine: failing as asked", flush=True)
        sys.exit(3)
    from kvcached.registry import registry_for

    budget = registry_for("cpu").register(os.environ["KVCACHED_NAME"])
    assert budget.try_acquire(int(os.environ.get("FAKE_ENGINE_MAPPED_BYTES", "0")))
    # A child that ignores SIGTERM: stopping the engine must still leave nothing behind.
    child = subprocess.Popen([sys.executable, "-c", _STUBBORN_CHILD])
    with open(os.environ["FAKE_ENGINE_RECORD"], "a") as record:
        kvcached_env = {k: v for k, v in os.environ.items() if k.startswith("KVCACHED_")}
        line = {"pid": os.getpid(), "child": child.pid, "args": vars(args), "extra": extra, "env": kvcached_env}
        record.write(json.dumps(line) + "\n")
    ThreadingHTTPServer((args.host, args.port), _Handler).serve_forever()


if __name__ == "__main__":
    main()
