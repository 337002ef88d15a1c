"""Sizes for people: the one parser and the formatters every option and tool uses.

A size is a whole number of bytes, written as digits with an optional decimal
fraction and an optional unit; spaces around the unit are allowed and case does
not matter (there are no bit units):

* none or ``B``: bytes (``4096``);
* ``K M G T P``, also spelt ``Ki``/``KiB`` ... ``Pi``/``PiB``: powers of 1024
  (``8G`` = 8 · 2³⁰);
* ``KB MB GB TB PB``: powers of 1000 (``2GB`` = 2 · 10⁹).

A fraction is accepted only when the result is a whole number of bytes
(``1.5G`` yes, ``0.5`` no). Signs, exponents (``1e9``), ``inf``, ``nan`` and
values of 2⁶³ bytes or more are refused with a ``ValueError`` that names the
option and quotes the text. The grammar is implemented once, in C++
(``kvcached/sizes.hpp``), so Python, C++, ``kvctl`` and every ``KVCACHED_*``
variable agree (:mod:`kvcached.option_values` adds each option's range).
"""

from __future__ import annotations

from typing import Optional

from kvcached import _core
from kvcached.errors import InvalidArgumentError, InvalidTypeError

#: Largest size accepted: 2⁶³ − 1 bytes.
MAX_SIZE_BYTES: int = int(_core.MAX_SIZE_BYTES)

_BINARY_STEP = 1024
_LONG_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
# One letter each, so a size fits in five cells ("512M", "3.5G").
_SHORT_UNITS = ("B", "K", "M", "G", "T", "P")
_ONE_DECIMAL_BELOW = 10


def parse_bytes(text: str, what: Optional[str] = None) -> int:
    """Parses a size (grammar above) into bytes.

    ``what`` names the option or variable for the error message, e.g.
    ``"KVCACHED_PAGE_BYTES"``.
    """
    if not isinstance(text, str):
        raise InvalidTypeError(f"a size must be given as text, got {type(text).__name__}")
    if not text.isascii():
        # Non-ASCII text (or bytes that were not UTF-8) can never be a size.
        shown = text.encode("utf-8", "backslashreplace").decode("ascii", "backslashreplace")
        prefix = f"{what}=" if what else ""
        raise InvalidArgumentError(f"{prefix}{shown!r} is not a size: sizes are ASCII (e.g. 4096, 512MiB, 8G, 2GB)")
    return int(_core.parse_size_bytes(text, what or ""))


def _scaled(count: int, units: tuple[str, ...]) -> tuple[float, str]:
    value = float(count)
    for unit in units:
        if abs(value) < _BINARY_STEP or unit == units[-1]:
            return value, unit
        value /= _BINARY_STEP
    raise AssertionError("unreachable")


def format_bytes(count: Optional[int]) -> str:
    """A size for people, in binary units: ``512 B``, ``1.5 GiB``; ``-`` for None.

    Rounded to one decimal (``parse_bytes`` reads the exact figure back only when
    it is whole bytes); machine-readable output carries exact integers instead.
    """
    if count is None:
        return "-"
    value, unit = _scaled(count, _LONG_UNITS)
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def format_bytes_short(count: Optional[int]) -> str:
    """A size in at most five cells for tables: ``512M``, ``3.5G``; ``-`` for None."""
    if count is None:
        return "-"
    value, unit = _scaled(count, _SHORT_UNITS)
    one_decimal = unit != "B" and value < _ONE_DECIMAL_BELOW
    return f"{value:.1f}{unit}" if one_decimal else f"{value:.0f}{unit}"


__all__ = ["MAX_SIZE_BYTES", "format_bytes", "format_bytes_short", "parse_bytes"]
