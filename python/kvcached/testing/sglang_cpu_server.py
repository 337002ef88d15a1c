"""SGLang's HTTP server on a CPU: ``python -m kvcached.testing.sglang_cpu_server ARGS`` = ``python -m
sglang.launch_server ARGS`` with SGLang's CPU set-up (:mod:`kvcached.testing.sglang_env`) first.

For ``kvcached serve`` on a machine without a GPU (``module:`` of an SGLang model in
``examples/serve-cpu.yaml``): the set-up reaches every process SGLang starts through the
environment, so nothing else changes. The set-up happens on import, not only when run:
``kvcached serve --check`` imports this module and then SGLang's server, as the engine will, and
that import needs it. Test infrastructure, like the shims it installs.
"""

from __future__ import annotations

import runpy
import sys

from kvcached.testing.sglang_env import use_sglang_cpu

SERVER_MODULE = "sglang.launch_server"

use_sglang_cpu()


def main() -> None:
    sys.argv[0] = SERVER_MODULE
    runpy.run_module(SERVER_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
