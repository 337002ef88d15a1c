"""A hostile or broken serve config is one short error naming its key, in bounded time and memory:
aliases that expand ("billion laughs"), non-UTF-8 text, huge numbers, deep nesting, NUL bytes,
non-ASCII digits, oversized files; and a relative ``python`` keeps the venv's own path."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("yaml", reason="kvcached serve needs the serve extra: pip install '.[serve]'")

from kvcached.errors import ServeConfigError  # noqa: E402
from kvcached.serve.command import missing_requirements  # noqa: E402
from kvcached.serve.config import load_config, parse_config  # noqa: E402
from kvcached.serve.config_limits import MAX_FILE_BYTES  # noqa: E402

# Every refusal here is quick; a refusal that expanded or re-read what it refuses would not be.
QUICK_S = 5.0
SHORT_MESSAGE_CHARS = 600

BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
device: cpu
models: [*i]
"""


def model(**keys) -> dict:
    return {"name": "a", "engine": "vllm", "model": "/models/a", **keys}


def refused_file(tmp_path, content) -> str:
    path = tmp_path / "serve.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    started = time.monotonic()
    with pytest.raises(ServeConfigError) as caught:
        load_config(path)
    assert time.monotonic() - started < QUICK_S
    message = str(caught.value)
    assert message.startswith(f"{path}: ") and "\n" not in message and len(message) < SHORT_MESSAGE_CHARS, message
    return message[len(f"{path}: ") :]


def refused(data) -> str:
    started = time.monotonic()
    with pytest.raises(ServeConfigError) as caught:
        parse_config(data)
    assert time.monotonic() - started < QUICK_S
    message = str(caught.value)
    assert "\n" not in message and len(message) < SHORT_MESSAGE_CHARS, message
    return message


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    message = refused_file(tmp_path, BILLION_LAUGHS)
    assert message.startswith("b[0]: YAML aliases (*a) are not accepted"), message


def test_a_file_that_is_not_utf8_is_one_error_naming_the_byte(tmp_path):
    message = refused_file(tmp_path, b"device: cpu\nmodels:\n  - name: caf\xe9\n")
    assert message == "not UTF-8 text: byte 0xe9 on line 3; save the file as UTF-8"


def test_a_file_larger_than_any_config_is_refused_unread(tmp_path):
    message = refused_file(tmp_path, b"#" * (MAX_FILE_BYTES + 1))
    assert message.startswith("larger than 256 KiB"), message


def test_a_5000_digit_number_is_refused_naming_its_key(tmp_path):
    text = f"device: cpu\nmodels:\n  - {{name: a, engine: vllm, model: /m, memory: {{min: {'9' * 5000}}}}}\n"
    message = refused_file(tmp_path, text)
    assert message.startswith("models[0].memory.min: a number of 5000 characters"), message
    data = {"device": "cpu", "models": [model(memory={"max": 10**5000})]}
    assert refused(data).startswith("models[0].memory.max: a number of about 5001 digits")


def test_5000_deep_nesting_is_refused_naming_where(tmp_path):
    message = refused_file(tmp_path, "device: cpu\nmodels: " + "[" * 5000 + "]" * 5000 + "\n")
    assert message.startswith("models[0][0][0]") and "nested deeper than 16 levels" in message, message
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    message = refused({"device": "cpu", "models": [model(args=deep)]})
    assert message.startswith("models[0].args[0][0]") and "nested deeper than 16 levels" in message, message


@pytest.mark.parametrize(
    "change, key",
    [
        (lambda m: m.update(args=["--max-model-len", "40\x0096"]), "models[0].args[1]"),
        (lambda m: m.update(env={"X": "a\x00b"}), "models[0].env.X"),
        (lambda m: m.update(env={"X\x00Y": "1"}), "models[0].env"),
        (lambda m: m.update(python="/usr/bin/python3\x00"), "models[0].python"),
        (lambda m: m.update(module="vllm\x00.x"), "models[0].module"),
        (lambda m: m.update(model="/models/\x00a"), "models[0].model"),
    ],
)
def test_a_nul_byte_anywhere_is_refused_naming_its_key(change, key):
    spec = model()
    change(spec)
    message = refused({"device": "cpu", "models": [spec]})
    assert message.startswith(f"{key}: ") and "NUL byte" in message, message


def test_a_nul_byte_written_in_yaml_is_refused(tmp_path):
    message = refused_file(tmp_path, 'device: cpu\nmodels: [{name: a, engine: vllm, model: /m, args: ["--x\\0"]}]\n')
    assert message.startswith("models[0].args[0]: ") and "NUL byte" in message, message


@pytest.mark.parametrize("listen", ["127.0.0.1:١٨٩٩٩", "127.0.0.1:８０００", "127.0.0.1:+8000", "127.0.0.1: 8000"])
def test_a_port_is_ascii_digits_only(listen):
    message = refused({"device": "cpu", "listen": listen, "models": [model()]})
    assert message.startswith("listen: expected host:port"), message


def test_what_a_message_quotes_is_cut_short():
    message = refused({"device": "cpu", "models": [model(args="x" * 100_000)]})
    assert message.startswith("models[0].args: expected a list of command-line words"), message
    message = refused({"device": "cpu", "models": [model(memory={"min": ["1GiB"] * 100_000})]})
    assert message.startswith("models[0].memory.min: expected"), message
    message = refused({"device": "cpu", "y" * 100_000: 1, "models": [model()]})
    assert "unknown key" in message
    # A grammar's own message may quote the whole text it refused: the message is cut all the same.
    message = refused({"device": "cpu", "models": [model(memory={"min": "9" * 30 + "Q" * 100_000})]})
    assert message.startswith("models[0].memory.min: ") and "not a size" in message, message
    assert refused({"device": "c" * 100_000, "models": [model()]}).startswith("device: bad device")


def test_a_relative_python_keeps_the_venv_path_it_names(tmp_path):
    # A venv's bin/python is a link to the base interpreter: resolving it leaves the venv.
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").symlink_to(sys.executable)
    (tmp_path / "conf").mkdir()
    path = tmp_path / "conf" / "serve.yaml"
    path.write_text(
        "device: cpu\nlog_dir: ../logs\nmodels:\n  - {name: s, engine: vllm, model: /m, python: ../venv/bin/python}\n"
    )
    config = load_config(path)
    assert config.models[0].python == str(venv_bin / "python")
    assert config.models[0].python_written == "../venv/bin/python"
    assert config.log_dir == str(tmp_path / "logs")


@pytest.mark.skipif(bool(missing_requirements()), reason="kvcached serve needs the serve extra: pip install '.[serve]'")
def test_check_refuses_a_billion_laughs_file_in_one_line(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text(BILLION_LAUGHS)
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvcached", "serve", str(path), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert time.monotonic() - started < 60
    assert done.returncode == 1 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"kvcached: error: {path}: b[0]: YAML aliases (*a) are not accepted"), done.stderr
