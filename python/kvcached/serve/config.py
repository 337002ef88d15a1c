"""``kvcached serve``'s configuration: the YAML schema, read and checked whole before anything starts.

Every mistake is one :class:`~kvcached.errors.ServeConfigError` naming the key
(``models[1].memory.min``) and saying what is expected; nothing is started until the
whole file passes. The schema, with defaults::

    listen: 127.0.0.1:8000        # host:port of the OpenAI-compatible endpoint
    device: cuda:0                # required: cpu, cuda:N, hip:N (one kvcached device per serve)
    budget: 60GiB                 # optional: the device budget kvcached may hand out
    log_dir: /var/log/kvcached    # optional: engine logs (default: a new temporary directory)
    startup_timeout_s: 900        # an engine not healthy by then stops the start
    stop_timeout_s: 30            # SIGTERM, then SIGKILL after this long
    wake_timeout_s: 300           # a request for a sleeping model waits this long for it, then 503
    restart: {max_attempts: 5, backoff_s: 1, max_backoff_s: 30}
    models:
      - name: qwen-small          # the OpenAI `model` clients send; the engine's KVCACHED_NAME
        engine: vllm              # vllm | sglang
        model: Qwen/Qwen2.5-0.5B-Instruct
        python: /opt/vllm/bin/python   # optional: the engine's environment (default: this one)
        module: vllm.entrypoints.openai.api_server   # optional: what `python -m` runs
        args: ["--max-model-len", "4096"]
        env: {}
        memory: {min: 2GiB, max: 20GiB, priority: 1}
        sleep: {level: 1, idle_s: 600}   # optional: may sleep when idle (docs/serve.md); none: never
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Any

from kvcached.config import OPTIONS
from kvcached.errors import KvcachedError, ServeConfigError
from kvcached.option_values import InstanceName, Size, describe
from kvcached.registry import MemoryPolicy
from kvcached.serve.config_limits import capped, check_values, key_text, load_yaml, read_config_file, shown
from kvcached.serve.engines import ENGINES, OWNED_ARGUMENTS, POLICY_VARIABLES
from kvcached.serve.fit import check_fit
from kvcached.serve.owned_arguments import owned_flag
from kvcached.serve.spec import (
    DEFAULT_STARTUP_TIMEOUT_S,
    DEFAULT_STOP_TIMEOUT_S,
    DEFAULT_WAKE_TIMEOUT_S,
    ModelSpec,
    RestartPolicy,
    ServeConfig,
    SleepPolicy,
)
from kvcached.sizes import format_bytes

DEFAULT_LISTEN = "127.0.0.1:8000"

_TOP_KEYS = (
    "listen",
    "device",
    "budget",
    "log_dir",
    "startup_timeout_s",
    "stop_timeout_s",
    "wake_timeout_s",
    "restart",
    "models",
)
_MODEL_KEYS = ("name", "engine", "model", "python", "module", "args", "env", "memory", "sleep")
_SLEEP_KEYS = ("level", "idle_s")
_MEMORY_KEYS = ("min", "max", "priority")
_RESTART_KEYS = ("max_attempts", "backoff_s", "max_backoff_s")
_PORT = re.compile(r"[0-9]{1,5}")  # ASCII digits only: str.isdigit() and int() take '١٨٩٩٩' too


def _fail(key: str, message: str) -> ServeConfigError:
    return ServeConfigError(f"{key}: {capped(message)}")


def _check_keys(section: Any, allowed: tuple[str, ...], where: str) -> dict:
    if not isinstance(section, dict):
        raise _fail(where or "the file", f"expected a mapping of keys ({', '.join(allowed)})")
    for key in section:
        if key not in allowed:
            name = key_text(key)
            raise _fail(f"{where}.{name}" if where else name, f"unknown key; expected one of {', '.join(allowed)}")
    return section


def _text(value: Any, key: str, what: str = "text") -> str:
    if not isinstance(value, str) or not value.strip():
        raise _fail(key, f"expected {what}, got {shown(value)}")
    return value.strip()


def _size(value: Any, key: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _fail(key, f"expected a size (4096, 512MiB, 8GiB), got {shown(value)}")
    try:
        return Size()(str(value).strip())
    except ValueError as exc:
        raise _fail(key, f"{shown(value)} is {exc}") from None


def _seconds(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise _fail(key, f"expected a number of seconds above 0, got {shown(value)}")
    return float(value)


def _whole(value: Any, key: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _fail(key, f"expected a whole number from {low} to {high}, got {shown(value)}")
    return value


def _listen(value: Any) -> tuple[str, int]:
    text = _text(value, "listen", "host:port (127.0.0.1:8000)")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not _PORT.fullmatch(port) or not 0 < int(port) < 65536:
        raise _fail("listen", f"expected host:port with a port from 1 to 65535 (127.0.0.1:8000), got {shown(text)}")
    return host.strip("[]"), int(port)


def _device(value: Any) -> str:
    from kvcached.devices import parse_device

    text = _text(value, "device", "a device (cpu, cuda:0, hip:0)")
    try:
        backend, ordinal = parse_device(text)
    except (KvcachedError, ValueError) as exc:
        raise _fail("device", str(exc)) from None
    return "cpu" if backend == "host" else f"{text.split(':')[0].lower()}:{ordinal}"


def _option(name: str, value: Any, key: str) -> Any:
    """``value`` read by the grammar of the ``KVCACHED_*`` option the engine gets it through."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise _fail(key, f"expected {describe(OPTIONS[name].parse)}, got {shown(value)}")
    try:
        return OPTIONS[name].parse(str(value).strip())
    except ValueError as exc:
        raise _fail(key, f"{shown(value)} is {exc}") from None


def _memory(value: Any, key: str) -> MemoryPolicy:
    section = _check_keys(value, _MEMORY_KEYS, key)
    min_bytes = _option("min_bytes", section["min"], f"{key}.min") if "min" in section else 0
    max_bytes = _option("max_bytes", section["max"], f"{key}.max") if "max" in section else None
    priority = _option("priority", section["priority"], f"{key}.priority") if "priority" in section else 0
    if max_bytes is not None and min_bytes > max_bytes:
        raise _fail(key, f"min ({format_bytes(min_bytes)}) is above max ({format_bytes(max_bytes)})")
    return MemoryPolicy(min_bytes, max_bytes, priority)


def _sleep(value: Any, key: str) -> SleepPolicy:
    section = _check_keys(value if value is not None else {}, _SLEEP_KEYS, key)
    level = _whole(section.get("level", 1), f"{key}.level", 1, 2)
    idle_s = _seconds(section["idle_s"], f"{key}.idle_s") if "idle_s" in section else None
    return SleepPolicy(level=level, idle_s=idle_s)


def _args(value: Any, key: str, engine: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(
        isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in value
    ):
        raise _fail(key, f'expected a list of command-line words (["--max-model-len", "4096"]), got {shown(value)}')
    words = tuple(str(a) for a in value)
    for index, word in enumerate(words):
        flag = owned_flag(word, OWNED_ARGUMENTS[engine])
        if flag is None:
            continue
        what = flag if word.split("=", 1)[0] == flag else f"{shown(word)} is read as {flag}, which"
        raise _fail(
            key if what == flag else f"{key}[{index}]",
            f"{what} is set by kvcached serve (from the model's name, model and a free port); remove it",
        )
    return words


def _env(value: Any, key: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise _fail(key, f"expected a mapping of environment variables, got {shown(value)}")
    env: dict[str, str] = {}
    for name, setting in value.items():
        if not isinstance(name, str) or not name or "=" in name:
            raise _fail(key, f"{shown(name)} is not an environment variable name")
        if isinstance(setting, bool) or not isinstance(setting, (str, int, float)):
            raise _fail(f"{key}.{key_text(name)}", f"expected text or a number, got {shown(setting)}")
        if name in POLICY_VARIABLES:
            raise _fail(f"{key}.{name}", "is set by kvcached serve from the model's name and memory; remove it")
        env[name] = str(setting)
    return env


def _model(value: Any, index: int, base_dir: Path) -> ModelSpec:
    key = f"models[{index}]"
    section = _check_keys(value, _MODEL_KEYS, key)
    for required in ("name", "engine", "model"):
        if required not in section:
            raise _fail(f"{key}.{required}", "missing; every model needs name, engine and model")
    name = _text(section["name"], f"{key}.name", "a name")
    try:
        InstanceName()(name)
    except ValueError as exc:
        raise _fail(f"{key}.name", f"{shown(name)}: {exc}") from None
    engine = _text(section["engine"], f"{key}.engine", "an engine")
    if engine not in ENGINES:
        raise _fail(f"{key}.engine", f"{shown(engine)} is not an engine; expected one of {', '.join(ENGINES)}")
    model = _text(section["model"], f"{key}.model", "a model (a Hugging Face id or a directory)")
    written = _text(section.get("python", sys.executable), f"{key}.python", "the path of a Python interpreter")
    python = _path_from(base_dir, written) if os.sep in written else written  # a bare name is looked up in PATH
    module = _text(section.get("module", ENGINES[engine].module), f"{key}.module", "a Python module name")
    return ModelSpec(
        name=name,
        engine=engine,
        model=model,
        python=python,
        module=module,
        args=_args(section.get("args", []), f"{key}.args", engine),
        python_written=written,
        env=_env(section.get("env", {}), f"{key}.env"),
        memory=_memory(section.get("memory", {}), f"{key}.memory"),
        sleep=_sleep(section["sleep"], f"{key}.sleep") if "sleep" in section else None,
    )


def _path_from(base_dir: Path, written: str) -> str:
    """``written`` (``~`` expanded) relative to ``base_dir``, absolute and normalised without following
    symbolic links: a venv's ``bin/python`` is a link to the base interpreter, and only the link's own
    path makes Python use the venv."""
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(written)))


def _restart(value: Any) -> RestartPolicy:
    section = _check_keys(value, _RESTART_KEYS, "restart")
    default = RestartPolicy()
    return RestartPolicy(
        max_attempts=_whole(section.get("max_attempts", default.max_attempts), "restart.max_attempts", 0, 1000),
        backoff_s=_seconds(section.get("backoff_s", default.backoff_s), "restart.backoff_s"),
        max_backoff_s=_seconds(section.get("max_backoff_s", default.max_backoff_s), "restart.max_backoff_s"),
    )


def parse_config(data: Any, base_dir: Path = Path(".")) -> ServeConfig:
    """Checks a configuration already read from YAML (see the module docstring) and returns it.

    ``base_dir``: what a relative ``python`` or ``log_dir`` path is relative to (the file's folder).
    Does not look at the machine beyond parsing the device name: :mod:`kvcached.serve.machine_checks` does.
    """
    check_values(data)  # NUL bytes, huge numbers, deep nesting: refused before any message quotes them
    section = _check_keys(data, _TOP_KEYS, "")
    if "device" not in section:
        raise _fail("device", "missing; name the device the models share (cpu, cuda:0, hip:0)")
    if not section.get("models"):
        raise _fail("models", "missing or empty; list at least one model")
    if not isinstance(section["models"], list):
        raise _fail("models", "expected a list of models")
    host, port = _listen(section.get("listen", DEFAULT_LISTEN))
    models = tuple(_model(value, i, base_dir) for i, value in enumerate(section["models"]))
    seen: dict[str, int] = {}
    for i, spec in enumerate(models):
        if spec.name in seen:
            raise _fail(f"models[{i}].name", f"{shown(spec.name)} is already the name of models[{seen[spec.name]}]")
        seen[spec.name] = i
    budget = _size(section["budget"], "budget") if "budget" in section else None
    if budget is not None:
        check_fit(models, budget, "budget")
    log_dir = section.get("log_dir")
    if log_dir is not None:
        log_dir = _path_from(base_dir, _text(log_dir, "log_dir", "a directory"))
    return ServeConfig(
        host=host,
        port=port,
        device=_device(section["device"]),
        models=models,
        budget_bytes=budget,
        log_dir=log_dir,
        startup_timeout_s=_seconds(section.get("startup_timeout_s", DEFAULT_STARTUP_TIMEOUT_S), "startup_timeout_s"),
        stop_timeout_s=_seconds(section.get("stop_timeout_s", DEFAULT_STOP_TIMEOUT_S), "stop_timeout_s"),
        wake_timeout_s=_seconds(section.get("wake_timeout_s", DEFAULT_WAKE_TIMEOUT_S), "wake_timeout_s"),
        restart=_restart(section.get("restart", {})),
    )


def load_config(path: str | os.PathLike) -> ServeConfig:
    """Reads and checks the YAML file at ``path`` (see :func:`parse_config`), within the bounds of
    :mod:`kvcached.serve.config_limits` (size, encoding, aliases, depth, numbers)."""
    text = read_config_file(path)  # names the path itself
    try:
        return parse_config(load_yaml(text), Path(os.path.abspath(path)).parent)
    except ServeConfigError as exc:
        raise ServeConfigError(f"{path}: {exc}") from None


__all__ = [
    "ModelSpec",
    "RestartPolicy",
    "ServeConfig",
    "load_config",
    "parse_config",
]
