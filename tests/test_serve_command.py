"""``kvcached serve`` without its extra installed: one line saying what to install, never a traceback."""

from __future__ import annotations

import importlib.machinery
import importlib.util

import pytest

from kvcached.cli import main as cli
from kvcached.serve import command


def test_a_missing_extra_is_one_line_naming_what_to_install(monkeypatch, capsys, tmp_path):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args):
        # fastapi and PyYAML missing, the extra's other modules present, whatever this machine has.
        if name in ("fastapi", "yaml"):
            return None
        if name in command.SERVE_REQUIREMENTS:
            return importlib.machinery.ModuleSpec(name, None)
        return real_find_spec(name, *args)

    monkeypatch.setattr(command.importlib.util, "find_spec", find_spec)
    assert command.missing_requirements() == ["fastapi", "PyYAML"]
    assert cli.main(["serve", str(tmp_path / "serve.yaml")]) == 1
    err = capsys.readouterr().err
    assert err == (
        "kvcached: error: kvcached serve needs fastapi, PyYAML: pip install fastapi PyYAML "
        '(or the whole serve extra: pip install ".[serve]" in a kvcached clone)\n'
    )
    assert "kvcached[" not in err  # on the package index, "kvcached" is another project


def test_serve_is_a_subcommand_of_kvcached(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["serve", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "CONFIG.yaml" in out and "--check" in out and "--log-dir" in out
