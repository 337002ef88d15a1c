"""Bounds on what a ``kvcached serve`` config may hold, so that any file is judged in bounded time and memory.

A config is small: a few models, each a handful of keys, four levels deep. A hostile or broken
file must still be one error naming where it goes wrong, never a traceback, a hang or a
MemoryError. So the file is read up to :data:`MAX_FILE_BYTES`, as UTF-8 only; YAML aliases
(``*name``, which let a few lines expand to gigabytes: "billion laughs") are refused before
anything is built; nesting deeper than :data:`MAX_DEPTH` and numbers longer than
:data:`MAX_NUMBER_DIGITS` are refused while the YAML is composed, before Python's recursion or
integer-conversion limits are hit; NUL bytes, which no command line or environment can carry, are
refused anywhere. Every message quotes a value through :func:`shown`, which never prints more
than :data:`SHOWN_CHARS` characters of it.
"""

from __future__ import annotations

import os
import reprlib
from typing import Any

from kvcached.errors import ServeConfigError

#: Far above any real config (a few KiB), far below what takes PyYAML long to read.
MAX_FILE_BYTES = 256 * 1024
#: The schema needs four levels (models, a model, memory, a value); room for engine-specific lists.
MAX_DEPTH = 16
#: A size in bytes has at most 20 digits (2**64); anything much longer is a mistake.
MAX_NUMBER_DIGITS = 40
#: What an error message quotes of a value at most.
SHOWN_CHARS = 80
#: A whole message at most: a grammar's own message may quote the text it refused, whole.
MESSAGE_CHARS = 400

_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_LOG10_2 = 0.30103


class _ShortRepr(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 2
        self.maxstring = SHOWN_CHARS
        self.maxother = SHOWN_CHARS
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = 4

    def repr_int(self, value: int, level: int) -> str:
        # repr() of an int of over 4300 digits raises; a long one would fill the message.
        if _digits(value) > MAX_NUMBER_DIGITS:
            return f"<a number of about {_digits(value)} digits>"
        return repr(value)


_SHORT = _ShortRepr()


def shown(value: Any) -> str:
    """``value`` as an error message quotes it: Python's repr, cut to about :data:`SHOWN_CHARS` characters."""
    text = _SHORT.repr(value)
    return text if len(text) <= 2 * SHOWN_CHARS else text[: 2 * SHOWN_CHARS] + "..."


def capped(message: str) -> str:
    """``message`` cut to :data:`MESSAGE_CHARS` characters."""
    return message if len(message) <= MESSAGE_CHARS else message[:MESSAGE_CHARS] + "..."


def key_text(key: Any) -> str:
    """A mapping key as a path names it: as written when it is plain text, else quoted."""
    if isinstance(key, str) and key.isprintable() and 0 < len(key) <= SHOWN_CHARS:
        return key
    return shown(key)


def _digits(value: int) -> int:
    return max(1, int(abs(value).bit_length() * _LOG10_2) + 1)


def check_values(data: Any) -> None:
    """Refuses, naming the key, what no valid config holds anywhere: nesting deeper than
    :data:`MAX_DEPTH`, a string with a NUL byte, a number longer than :data:`MAX_NUMBER_DIGITS`.
    Walks without recursion, so it is safe on any structure."""
    pending: list[tuple[str, Any, int]] = [("", data, 0)]
    while pending:
        path, value, depth = pending.pop()
        where = path.lstrip(".") or "the file"
        if depth > MAX_DEPTH:
            raise ServeConfigError(f"{where}: nested deeper than {MAX_DEPTH} levels; no key of the config needs that")
        if isinstance(value, str) and "\0" in value:
            raise ServeConfigError(f"{where}: {shown(value)} holds a NUL byte, which no command line or file name can")
        if isinstance(value, int) and not isinstance(value, bool) and _digits(value) > MAX_NUMBER_DIGITS:
            raise ServeConfigError(
                f"{where}: a number of about {_digits(value)} digits; expected at most {MAX_NUMBER_DIGITS}"
            )
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and "\0" in key:
                    raise ServeConfigError(f"{where}: the key {shown(key)} holds a NUL byte")
                pending.append((f"{path}.{key_text(key)}", item, depth + 1))
        elif isinstance(value, (list, tuple)):
            pending.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))


def read_config_file(path: str | os.PathLike) -> str:
    """The text of the config file at ``path``: at most :data:`MAX_FILE_BYTES`, UTF-8."""
    try:
        with open(path, "rb") as file:
            raw = file.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ServeConfigError(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ServeConfigError(f"{path}: larger than {MAX_FILE_BYTES // 1024} KiB; a serve config is a few KiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ServeConfigError(
            f"{path}: not UTF-8 text: byte 0x{raw[exc.start]:02x} on line {line}; save the file as UTF-8"
        ) from None


def load_yaml(text: str) -> Any:
    """``text`` read as YAML (safe types only) within the bounds above; ServeConfigError naming
    the key (or the line) where it breaks one, or where it is not YAML."""
    import yaml

    class BoundedLoader(yaml.SafeLoader):
        """PyYAML's safe loader that refuses aliases, deep nesting and long numbers as it composes."""

        def __init__(self, stream: str) -> None:
            super().__init__(stream)
            self.path: list[str] = []

        def compose_node(self, parent: Any, index: Any) -> Any:
            if isinstance(index, yaml.ScalarNode):
                self.path.append(f".{key_text(index.value)}")
            elif isinstance(index, int) and not isinstance(index, bool):
                self.path.append(f"[{index}]")
            else:
                self.path.append("")  # the document, or a mapping's key itself
            try:
                event = self.peek_event()
                where = "".join(self.path).lstrip(".") or f"line {event.start_mark.line + 1}"
                if isinstance(event, yaml.AliasEvent):
                    raise ServeConfigError(
                        f"{where}: YAML aliases (*{key_text(event.anchor)}) are not accepted in a serve config; "
                        "write the value out"
                    )
                if len(self.path) > MAX_DEPTH + 1:
                    raise ServeConfigError(
                        f"{where}: nested deeper than {MAX_DEPTH} levels; no key of the config needs that"
                    )
                node = super().compose_node(parent, index)
            finally:
                self.path.pop()
            if (
                isinstance(node, yaml.ScalarNode)
                and node.tag in (_INT_TAG, _FLOAT_TAG)
                and len(node.value) > MAX_NUMBER_DIGITS
            ):
                raise ServeConfigError(
                    f"{where}: a number of {len(node.value)} characters; expected at most {MAX_NUMBER_DIGITS}"
                )
            return node

    try:
        return yaml.load(text, Loader=BoundedLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ServeConfigError(f"not valid YAML: {shown_yaml_error(exc)}") from None
    except RecursionError:  # a structure deeper than the checks above foresee: still one line
        raise ServeConfigError(f"nested too deeply (more than {MAX_DEPTH} levels are never needed)") from None


def shown_yaml_error(exc: Exception) -> str:
    """PyYAML's message on one line, cut to a few hundred characters (it quotes the file)."""
    text = " ".join(str(exc).split())
    return text if len(text) <= 4 * SHOWN_CHARS else text[: 4 * SHOWN_CHARS] + "..."


__all__ = [
    "MAX_DEPTH",
    "MAX_FILE_BYTES",
    "MAX_NUMBER_DIGITS",
    "MESSAGE_CHARS",
    "SHOWN_CHARS",
    "capped",
    "check_values",
    "key_text",
    "load_yaml",
    "read_config_file",
    "shown",
]
