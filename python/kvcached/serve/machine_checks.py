"""What ``kvcached serve`` (and ``--check``) verifies on this machine before anything starts.

The config file can be right and the machine still wrong for it: the log directory is a file or
cannot be written, a local model path does not exist, an engine's Python cannot run the engine.
Each is one :class:`~kvcached.errors.ServeConfigError` naming the key, found before any engine
starts. Every model's Python is probed (:func:`kvcached.serve.engines.check_environment`), once
per distinct environment and all at once, since a probe imports the whole engine.
"""

from __future__ import annotations

import concurrent.futures
import os
import tempfile
from pathlib import Path
from typing import Optional

from kvcached.errors import ServeConfigError
from kvcached.serve.config import ModelSpec, ServeConfig
from kvcached.serve.config_limits import shown
from kvcached.serve.engines import check_environment

# A Hugging Face id is "org/name" (or "name"); more slashes, or a leading ./ ../ / ~, is a local path.
_HUB_ID_SLASHES = 1


def looks_local(model: str) -> bool:
    """Whether ``model`` names a local path rather than a Hugging Face id."""
    return (
        os.path.isabs(model)
        or model.startswith(("./", "../", "~"))
        or model in (".", "..")
        or model.endswith("/")
        or model.count("/") > _HUB_ID_SLASHES
    )


def check_model_path(spec: ModelSpec, index: int) -> None:
    """Refuses a ``model`` that names a local path (see :func:`looks_local`) where nothing is."""
    if looks_local(spec.model) and not os.path.exists(os.path.expanduser(spec.model)):
        where = "" if os.path.isabs(os.path.expanduser(spec.model)) else f" (relative to {os.getcwd()})"
        raise ServeConfigError(
            f"models[{index}].model: {shown(spec.model)} does not exist{where}; write a model directory, "
            "or a Hugging Face id (org/name)"
        )


def check_log_dir(path: str, key: str) -> None:
    """Refuses a log directory that cannot hold files: an existing one must be a directory serve can
    write in; a missing one, below a directory serve can create it in."""
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if str(existing) == path else f"cannot be created: {existing} is a file"
        raise ServeConfigError(f"{key}: {shown(path)} {what}; name a directory")
    try:
        tempfile.TemporaryFile(dir=existing).close()  # as root, os.access() says yes to everything
    except OSError as exc:
        what = "cannot be written" if str(existing) == path else f"cannot be created in {existing}"
        raise ServeConfigError(f"{key}: {shown(path)} {what}: {exc.strerror or exc}") from None


def probe_environments(config: ServeConfig) -> None:
    """:func:`~kvcached.serve.engines.check_environment` for every model, one probe per distinct
    (python, engine, module, env), all at once; the first model in the file that fails is reported."""
    first_of: dict[tuple, int] = {}
    for index, spec in enumerate(config.models):
        first_of.setdefault((spec.python, spec.engine, spec.module, tuple(sorted(spec.env.items()))), index)
    indices = sorted(first_of.values())
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(indices)) as pool:
        futures = {i: pool.submit(check_environment, config.models[i], i, config.device) for i in indices}
    for index in indices:
        futures[index].result()  # raises the first model's ServeConfigError, in file order


def check_machine(config: ServeConfig, log_dir: Optional[str] = None) -> None:
    """Everything above, for ``config`` (``log_dir``: ``--log-dir``, which overrides the config's)."""
    if log_dir is not None:
        check_log_dir(log_dir, "--log-dir")
    elif config.log_dir is not None:
        check_log_dir(config.log_dir, "log_dir")
    for index, spec in enumerate(config.models):
        check_model_path(spec, index)
    probe_environments(config)


__all__ = ["check_log_dir", "check_machine", "check_model_path", "looks_local", "probe_environments"]
