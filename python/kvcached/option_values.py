"""The grammar of each kind of option value (sizes, counts, seconds, fractions, booleans, choices),
and :class:`Option`, what ties a ``KVCACHED_*`` variable to its grammar.

One grammar per kind, used by every ``KVCACHED_*`` variable of that kind. All of them are
ASCII only (``'٣'`` is no more a count than a size); :meth:`Option.get`
strips surrounding whitespace before any of them runs, the same way for every kind. A
grammar raises ``ValueError`` with the reason only; ``Option.get`` turns it into a
:class:`~kvcached.errors.ConfigurationError` naming the variable and its text. Each grammar
also describes itself for ``docs/configuration.md`` (``python -m kvcached.config_doc``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Callable, Generic, Optional, TypeVar

from kvcached.errors import ConfigurationError, InvalidArgumentError
from kvcached.sizes import MAX_SIZE_BYTES, format_bytes, parse_bytes

_DIGITS = re.compile(r"[0-9]+")
# A plain decimal: no sign, exponent, separator, inf or nan.
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")
_TRUE_WORDS = ("1", "true", "yes", "on")
_FALSE_WORDS = ("0", "false", "no", "off")

#: Largest page id count (and so the largest count of pages any option can mean): 2³² − 1.
MAX_PAGE_COUNT = (1 << 32) - 1
#: Largest gid a group setting may name: (gid_t)-1 means "no group" to chown().
MAX_GROUP_ID = (1 << 32) - 2


def _exact_size(count: int) -> str:
    """``count`` bytes as written in the docs: ``4KiB``, ``1GiB``, ``1000`` (exact only)."""
    for shift, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")):
        if count >= 1 << shift and count % (1 << shift) == 0:
            return f"{count >> shift}{unit}"
    return str(count)


@dataclasses.dataclass(frozen=True)
class Size:
    """A size (:mod:`kvcached.sizes`), at least ``minimum`` and at most ``maximum`` bytes,
    a multiple of ``multiple_of``; 0 is allowed too when ``zero_means`` says what it means."""

    minimum: int = 0
    maximum: int = MAX_SIZE_BYTES
    multiple_of: int = 1
    zero_means: str = ""

    def __call__(self, text: str) -> int:
        try:
            value = parse_bytes(text)
        except ValueError as exc:
            # The parser's message starts with the quoted text, which Option.get shows already.
            reason = str(exc).split(" is not a size: ", 1)[-1]
            raise InvalidArgumentError(f"not a size ({reason}); expected {self.describe()}") from None
        if value == 0 and self.zero_means:
            return 0
        if value < self.minimum or value > self.maximum or value % self.multiple_of:
            raise InvalidArgumentError(
                f"{format_bytes(value)} ({value} bytes) is out of range: expected {self.describe()}"
            )
        return value

    def describe(self) -> str:
        parts = ["a size (4096, 512MiB, 8G, 2GB)"]
        if self.multiple_of > 1:
            parts.append(f"a multiple of {_exact_size(self.multiple_of)}")
        if self.maximum < MAX_SIZE_BYTES:
            parts.append(f"from {_exact_size(self.minimum)} to {_exact_size(self.maximum)}")
        elif self.minimum > 0:
            parts.append(f"at least {_exact_size(self.minimum)}")
        text = ", ".join(parts)
        return f"{text}; or 0: {self.zero_means}" if self.zero_means else text


@dataclasses.dataclass(frozen=True)
class Count:
    """A whole number in ASCII digits, from ``minimum`` to ``maximum``."""

    minimum: int = 0
    maximum: int = MAX_PAGE_COUNT

    def __call__(self, text: str) -> int:
        if not _DIGITS.fullmatch(text):
            raise InvalidArgumentError(f"not a count: expected {self.describe()}")
        value = int(text)
        if not self.minimum <= value <= self.maximum:
            raise InvalidArgumentError(f"{value} is out of range: expected {self.describe()}")
        return value

    def describe(self) -> str:
        return f"a whole number from {self.minimum} to {self.maximum} (ASCII digits)"


@dataclasses.dataclass(frozen=True)
class Integer:
    """A whole number in ASCII digits with an optional minus sign, from ``minimum`` to ``maximum``."""

    minimum: int
    maximum: int

    def __call__(self, text: str) -> int:
        if not _DIGITS.fullmatch(text.removeprefix("-")):
            raise InvalidArgumentError(f"not a whole number: expected {self.describe()}")
        value = int(text)
        if not self.minimum <= value <= self.maximum:
            raise InvalidArgumentError(f"{value} is out of range: expected {self.describe()}")
        return value

    def describe(self) -> str:
        return f"a whole number from {self.minimum} to {self.maximum} (ASCII digits, optional minus sign)"


@dataclasses.dataclass(frozen=True)
class Seconds:
    """A finite, plain decimal number of seconds (``2.5``); 0 only when ``zero_means`` says what it means."""

    zero_means: str = ""

    def __call__(self, text: str) -> float:
        value = float(text) if _DECIMAL.fullmatch(text) else math.nan
        if math.isnan(value) or math.isinf(value) or (value == 0 and not self.zero_means):
            raise InvalidArgumentError(f"not a usable number of seconds: expected {self.describe()}")
        return value

    def describe(self) -> str:
        text = "seconds, a plain decimal above 0 (5, 2.5)"
        return f"{text}; or 0: {self.zero_means}" if self.zero_means else text


@dataclasses.dataclass(frozen=True)
class Fraction:
    """A plain decimal in (0, 1]."""

    def __call__(self, text: str) -> float:
        value = float(text) if _DECIMAL.fullmatch(text) else math.nan
        if not 0.0 < value <= 1.0:  # nan too
            raise InvalidArgumentError(f"not a fraction: expected {self.describe()}")
        return value

    def describe(self) -> str:
        return "a fraction in (0, 1], a plain decimal (0.9)"


@dataclasses.dataclass(frozen=True)
class Boolean:
    """``1/0``, ``true/false``, ``yes/no``, ``on/off``, in any case."""

    def __call__(self, text: str) -> bool:
        lowered = text.lower() if text.isascii() else ""
        if lowered in _TRUE_WORDS:
            return True
        if lowered in _FALSE_WORDS:
            return False
        raise InvalidArgumentError(f"not a boolean: expected {self.describe()}")

    def describe(self) -> str:
        return "a boolean: 1/0, true/false, yes/no, on/off"


@dataclasses.dataclass(frozen=True)
class Choice:
    """One of ``choices``, in any case (read back in lower case)."""

    choices: tuple[str, ...]

    def __call__(self, text: str) -> str:
        lowered = text.lower() if text.isascii() else ""
        if lowered not in self.choices:
            raise InvalidArgumentError(f"not a choice: expected {self.describe()}")
        return lowered

    def describe(self) -> str:
        return "one of " + ", ".join(self.choices[:-1]) + " or " + self.choices[-1]


@dataclasses.dataclass(frozen=True)
class AbsolutePath:
    """An absolute path: processes started from other working directories would read a relative one otherwise."""

    def __call__(self, text: str) -> str:
        if not text.startswith("/"):
            raise InvalidArgumentError("must be an absolute path (processes started elsewhere would disagree)")
        return text

    def describe(self) -> str:
        return "an absolute path"


@dataclasses.dataclass(frozen=True)
class InstanceName:
    """An instance name as the registry stores it (1–63 bytes of UTF-8, no control characters)."""

    def __call__(self, text: str) -> str:
        from kvcached._core import validate_instance_name

        validate_instance_name(text)
        return text

    def describe(self) -> str:
        return "a name: 1-63 bytes of UTF-8, no control characters"


@dataclasses.dataclass(frozen=True)
class GroupName:
    """A group this machine knows, by name or by gid (ASCII digits, at most 2³² − 2)."""

    def __call__(self, text: str) -> str:
        from kvcached._core import resolve_registry_group

        try:
            resolve_registry_group(text)  # the same lookup the registry makes: one parser
        except ValueError as exc:
            # The core names the variable and the text itself; Option.get does that here.
            raise InvalidArgumentError(str(exc).split(f"'{text}' is invalid: ", 1)[-1]) from None
        return text

    def describe(self) -> str:
        return f"a group name, or a gid from 0 to {MAX_GROUP_ID}"


T = TypeVar("T")


# What the shell counts as surrounding whitespace; stripped the same way for every option.
_WHITESPACE = " \t\n\r\f\v"


@dataclasses.dataclass(frozen=True)
class Option(Generic[T]):
    """One option: its variable, its default (used when unset or empty), its grammar
    (:mod:`kvcached.option_values`), its meaning and what reads it."""

    env: str
    default: T
    parse: Callable[[str], T]
    doc: str
    #: What reads the option, for the docs ("pools", "device registry", ...).
    read_by: str = ""
    #: What the default means, for the docs (for an unset default: what happens then).
    default_note: str = ""
    #: Older names still honoured when ``env`` is unset.
    aliases: tuple[str, ...] = ()

    def get(self) -> T:
        """The variable's value (surrounding whitespace ignored), else the default when it is
        unset or empty. A value the grammar refuses raises :class:`ConfigurationError` naming
        the variable, its text and what is expected."""
        env = next((name for name in (self.env, *self.aliases) if os.environ.get(name)), self.env)
        raw = os.environ.get(env)
        text = raw.strip(_WHITESPACE) if raw is not None else ""
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            shown = raw.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
            raise ConfigurationError(f"{env}={shown!r} is invalid: {exc}") from None


def describe(grammar: object) -> Optional[str]:
    """What ``grammar`` accepts, for the docs (None for a parser without a description)."""
    method = getattr(grammar, "describe", None)
    return method() if callable(method) else None


__all__ = [
    "MAX_GROUP_ID",
    "MAX_PAGE_COUNT",
    "AbsolutePath",
    "Boolean",
    "Choice",
    "Count",
    "Fraction",
    "GroupName",
    "InstanceName",
    "Option",
    "Seconds",
    "Size",
    "describe",
]
