"""Where the serve benchmarks run (bench/e2e/e2e_common.py's ``in_workdir``): a kept folder or a temporary one."""

from __future__ import annotations

from pathlib import Path

from e2e_common import in_workdir  # bench/e2e, on the path through pyproject's pytest settings


def test_a_named_workdir_is_made_and_kept(tmp_path):
    named = tmp_path / "runs" / "first"
    result = in_workdir(str(named), "unused-", lambda workdir: (workdir, workdir.is_dir()))
    assert result == (named, True) and named.is_dir()


def test_without_one_the_run_gets_a_temporary_folder_removed_afterwards():
    seen: list[Path] = []
    answer = in_workdir(None, "kvcached-test-", lambda workdir: seen.append(workdir) or 42)
    assert answer == 42 and seen[0].name.startswith("kvcached-test-") and not seen[0].exists()
