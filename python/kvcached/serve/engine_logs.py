"""Each engine's log file: a name derived from the model's name that stays inside the log directory.

A model name is what clients send as ``model`` and may hold any printable character: vLLM's own
default served name is ``Qwen/Qwen2.5-0.5B-Instruct``, and ``../x`` or ``/etc/x`` are valid names
too. Used as a path, such a name would point into a folder that does not exist, or out of the log
directory. So the file name keeps only letters, digits, ``.``, ``_`` and ``-`` of it, and a name
that had to change gets a short hash of itself appended, so two models never share a log.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

_UNSAFE_RUN = re.compile(r"[^A-Za-z0-9._-]+")
_HASH_CHARS = 8
# The end of a log is all that is shown; an engine's log can grow to gigabytes.
_TAIL_BYTES = 64 * 1024
#: How the line serve writes before each launch of an engine (its command line) begins.
LAUNCH_HEADER = "=== kvcached serve: "


def log_file_name(model_name: str) -> str:
    """The log file name of model ``model_name``: ``qwen-small.log``, ``Qwen_Qwen2.5-0.5B-Instruct-1a2b3c4d.log``."""
    stem = _UNSAFE_RUN.sub("_", model_name).strip("._-")
    if stem != model_name:
        digest = hashlib.sha256(model_name.encode("utf-8", "surrogatepass")).hexdigest()[:_HASH_CHARS]
        stem = f"{stem}-{digest}" if stem else digest
    return f"{stem}.log"


def read_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of the file at ``path`` (of its last 64 KiB; "" when it cannot be read)."""
    try:
        with open(path, "rb") as log:
            log.seek(0, 2)
            log.seek(max(0, log.tell() - _TAIL_BYTES))
            text = log.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


__all__ = ["LAUNCH_HEADER", "log_file_name", "read_tail"]
