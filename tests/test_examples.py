"""The example that needs no engine runs, with kvcached alone, and shows memory moving between pools."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
EXAMPLE_TIMEOUT_S = 120


def test_two_pools_one_budget_runs_without_torch(env_without_torch):
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / "two_pools_one_budget.py"), "--budget", "32MiB"],
        env=env_without_torch,
        check=False,
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    # a fills the budget and b is refused; after a gives its pages back, b gets the same memory.
    assert "registry: a 32 MiB, b 0 MiB" in lines[2], done.stdout
    assert lines[3].strip().startswith("b: 0 blocks, then refused") and "memory budget" in lines[3], done.stdout
    assert "registry: a 0 MiB, b 32 MiB" in lines[-2] and lines[-1] == "both closed: 0 bytes mapped", done.stdout
