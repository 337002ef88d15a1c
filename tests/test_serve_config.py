"""``kvcached serve``'s config is checked whole before anything starts: one clear error per mistake, naming its key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("yaml", reason="kvcached serve needs the serve extra: pip install '.[serve]'")

from kvcached.errors import KvcachedError, ServeConfigError  # noqa: E402
from kvcached.serve.command import missing_requirements  # noqa: E402
from kvcached.serve.config import load_config, parse_config  # noqa: E402
from kvcached.serve.engines import check_environment, engine_environment  # noqa: E402

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
MiB = 1 << 20


def config(**top) -> dict:
    model = {"name": "a", "engine": "vllm", "model": "/models/a"}
    base = {"device": "cpu", "models": [model]}
    base.update(top)
    return base


def refused(data) -> str:
    with pytest.raises(ServeConfigError) as caught:
        parse_config(data)
    assert isinstance(caught.value, KvcachedError) and isinstance(caught.value, ValueError)
    return str(caught.value)


def test_a_minimal_config_gets_the_defaults():
    parsed = parse_config(config())
    assert (parsed.host, parsed.port, parsed.device, parsed.budget_bytes) == ("127.0.0.1", 8000, "cpu", None)
    (model,) = parsed.models
    assert model.python == sys.executable and model.module == "vllm.entrypoints.openai.api_server"
    assert (model.memory.min_bytes, model.memory.max_bytes, model.memory.priority) == (0, None, 0)
    assert parsed.restart.delay_s(1) == 1.0 and parsed.restart.delay_s(4) == 8.0 and parsed.restart.delay_s(99) == 30.0


def test_sizes_use_kvcached_size_grammar():
    data = config(budget="1GiB")
    data["models"][0]["memory"] = {"min": "64MiB", "max": 128 * MiB, "priority": -3}
    memory = parse_config(data).models[0].memory
    assert (memory.min_bytes, memory.max_bytes, memory.priority) == (64 * MiB, 128 * MiB, -3)


@pytest.mark.parametrize(
    "change, key, words",
    [
        (lambda d: d.update(colour="red"), "colour: unknown key", "listen, device"),
        (lambda d: d["models"][0].update(gpu=1), "models[0].gpu: unknown key", "memory"),
        (
            lambda d: d["models"][0].update(memory={"minimum": "1GiB"}),
            "models[0].memory.minimum: unknown key",
            "min, max, priority",
        ),
        (lambda d: d["models"][0].update(memory={"min": "lots"}), "models[0].memory.min:", "not a size"),
        (lambda d: d["models"][0].update(memory={"max": "-1G"}), "models[0].memory.max:", "not a size"),
        (lambda d: d["models"][0].update(memory={"min": "2G", "max": "1G"}), "models[0].memory:", "above max"),
        (lambda d: d["models"][0].update(memory={"priority": "high"}), "models[0].memory.priority:", "whole number"),
        (lambda d: d["models"][0].update(memory={"priority": 2**31}), "models[0].memory.priority:", "whole number"),
        (lambda d: d.update(budget="12 parsecs"), "budget:", "not a size"),
        (lambda d: d.update(listen="localhost"), "listen:", "host:port"),
        (lambda d: d.update(listen="127.0.0.1:99999"), "listen:", "port from 1 to 65535"),
        (lambda d: d.update(device="tpu:0"), "device:", "bad device"),
        (lambda d: d.pop("device"), "device: missing", "cpu, cuda:0"),
        (lambda d: d.update(models=[]), "models: missing or empty", "at least one"),
        (lambda d: d["models"][0].pop("model"), "models[0].model: missing", "name, engine and model"),
        (lambda d: d["models"][0].update(engine="tgi"), "models[0].engine:", "vllm, sglang"),
        (lambda d: d["models"][0].update(name="x" * 64), "models[0].name:", "63"),
        (lambda d: d["models"][0].update(args="--max-model-len 4096"), "models[0].args:", "list of command-line words"),
        (
            lambda d: d["models"][0].update(args=["--port", "9000"]),
            "models[0].args:",
            "--port is set by kvcached serve",
        ),
        (lambda d: d["models"][0].update(args=["--served-model-name=b"]), "models[0].args:", "--served-model-name"),
        (
            lambda d: d["models"][0].update(env={"KVCACHED_NAME": "b"}),
            "models[0].env.KVCACHED_NAME:",
            "set by kvcached serve",
        ),
        (lambda d: d["models"][0].update(env={"X": ["a"]}), "models[0].env.X:", "text or a number"),
        (lambda d: d.update(restart={"max_attempts": -1}), "restart.max_attempts:", "whole number"),
        (lambda d: d.update(stop_timeout_s=0), "stop_timeout_s:", "above 0"),
    ],
)
def test_each_mistake_is_one_error_naming_its_key(change, key, words):
    data = config()
    change(data)
    message = refused(data)
    assert message.startswith(key) and words in message, message


def test_duplicate_names_name_both_models():
    data = config()
    data["models"].append({"name": "a", "engine": "sglang", "model": "/models/b"})
    assert refused(data) == "models[1].name: 'a' is already the name of models[0]"


def test_mins_above_the_budget_are_refused():
    data = config(budget="100MiB")
    data["models"][0]["memory"] = {"min": "60MiB"}
    data["models"].append({"name": "b", "engine": "vllm", "model": "/m", "memory": {"min": "50MiB"}})
    message = refused(data)
    assert message.startswith("budget:") and "110.0 MiB" in message and "100.0 MiB" in message


def test_a_file_that_is_not_yaml_or_not_there_is_one_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("models: [\n")
    with pytest.raises(ServeConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ServeConfigError, match="cannot be read"):
        load_config(tmp_path / "missing.yaml")


def test_a_relative_python_is_relative_to_the_config_file(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("device: cpu\nmodels:\n  - {name: s, engine: sglang, model: /m, python: env/bin/python}\n")
    assert load_config(path).models[0].python == str(tmp_path / "env" / "bin" / "python")


def test_a_python_that_cannot_import_the_engine_is_refused_naming_the_module(tmp_path):
    # This Python without its site-packages (-S): a Python where vLLM is not installed.
    bare = tmp_path / "bare-python"
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    data = config()
    data["models"][0]["python"] = str(bare)
    spec = parse_config(data).models[0]
    with pytest.raises(ServeConfigError) as caught:
        check_environment(spec, 0, "cpu")
    message = str(caught.value)
    assert message.startswith(f"models[0].python: '{bare}' cannot import vllm"), message
    assert "python -m vllm.entrypoints.openai.api_server" in message


def test_a_python_that_does_not_exist_is_refused():
    data = config()
    data["models"][0]["python"] = "/nonexistent/bin/python"
    spec = parse_config(data).models[0]
    with pytest.raises(ServeConfigError, match=r"models\[0\]\.python: '/nonexistent/bin/python' cannot be run"):
        check_environment(spec, 0, "cpu")


def test_the_engine_gets_kvcached_on_under_the_model_name_with_its_policy():
    data = config()
    data["models"][0]["memory"] = {"min": "1MiB", "max": "2MiB", "priority": 5}
    data["models"][0]["env"] = {"EXTRA": 1}
    spec = parse_config(data).models[0]
    base = {"PATH": "/bin", "KVCACHED_NAME": "inherited", "ENABLE_KVCACHED": "0", "CUDA_VISIBLE_DEVICES": "3,5"}
    env = engine_environment(spec, "cuda:1", base)
    assert env["KVCACHED_ENABLE"] == "1" and "ENABLE_KVCACHED" not in env and env["KVCACHED_NAME"] == "a"
    assert (env["KVCACHED_MIN_BYTES"], env["KVCACHED_LIMIT_BYTES"], env["KVCACHED_PRIORITY"]) == (
        str(MiB),
        str(2 * MiB),
        "5",
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "5" and env["EXTRA"] == "1" and env["PATH"] == "/bin"
    assert "KVCACHED_LIMIT_BYTES" not in engine_environment(parse_config(config()).models[0], "cpu", {})


@pytest.mark.parametrize("example", ["serve-cpu.yaml", "serve-gpu.yaml"])
def test_the_example_configs_are_valid(example):
    parsed = load_config(EXAMPLES / example)
    assert {spec.engine for spec in parsed.models} == {"vllm", "sglang"}


# What the tiny model's weights hold in the registry on vLLM's CPU build (two 2 MiB pages).
TINY_WEIGHTS_BYTES = 4 << 20


def test_the_sleep_example_holds_more_models_than_fit_awake():
    parsed = load_config(EXAMPLES / "serve-sleep-cpu.yaml")
    assert all(spec.sleep is not None for spec in parsed.models)
    awake = [spec.memory.min_bytes + TINY_WEIGHTS_BYTES for spec in parsed.models]
    assert sum(sorted(awake)[:2]) <= parsed.budget_bytes < sum(awake), "two fit awake, three do not"


@pytest.mark.skipif(bool(missing_requirements()), reason="kvcached serve needs the serve extra: pip install '.[serve]'")
def test_the_command_checks_before_starting_anything(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("device: cpu\nmodels:\n  - {name: a, engine: vllm, model: /m, memory: {min: 1XB}}\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvcached", "serve", str(path)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("kvcached: error: ") and "models[0].memory.min: '1XB' is not a size" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


@pytest.mark.parametrize(
    "engine, words, flag",
    [
        ("vllm", ["--hos", "0.0.0.0"], "--host"),
        ("vllm", ["--hos=0.0.0.0"], "--host"),
        ("vllm", ["--po", "9000"], "--port"),
        ("vllm", ["--p=9000"], "--port"),
        ("vllm", ["--mod", "/other"], "--model"),
        ("vllm", ["--served_model_name", "b"], "--served-model-name"),  # vLLM reads _ as -
        ("vllm", ["--serv", "b"], "--served-model-name"),
        ("vllm", ["--port.x", "1"], "--port"),  # vLLM's dotted JSON keys
        ("sglang", ["--model-pa", "/other"], "--model-path"),
        ("sglang", ["--model_path", "/other"], "--model-path"),
    ],
)
def test_abbreviations_of_the_arguments_serve_sets_are_refused(engine, words, flag):
    data = config()
    data["models"][0].update(engine=engine, args=["--dtype", "float32", *words])
    message = refused(data)
    assert message.startswith("models[0].args[2]: ") and f"is read as {flag}, which is set by kvcached serve" in message


@pytest.mark.parametrize("word", ["--model-impl", "--max-model-len", "--port-range", "--hf-overrides.x", "-tp", "--"])
def test_other_arguments_pass(word):
    data = config()
    data["models"][0]["args"] = [word, "1"]
    assert parse_config(data).models[0].args == (word, "1")


def test_every_config_in_the_serve_docs_parses():
    """The YAML blocks of docs/serve.md are configs a user copies: each must pass the parser."""
    import re

    import yaml

    text = (Path(__file__).resolve().parents[1] / "docs" / "serve.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) >= 2
    for block in blocks:
        data = yaml.safe_load(block)
        data.setdefault("device", "cpu")
        config = parse_config(data)
        assert config.models
