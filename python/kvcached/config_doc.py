"""Writes the options table of ``docs/configuration.md`` from :data:`kvcached.config.OPTIONS`.

The table is generated, never edited by hand: ``python -m kvcached.config_doc`` prints it,
``--write PATH`` puts it in place in the document, ``--check PATH`` exits 1 when the document's
table differs (a test does the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from kvcached.cli.support import quiet_on_broken_pipe
from kvcached.config import OPTIONS, Option
from kvcached.option_values import Size, describe

#: The heading the table follows; the table runs to the next blank line.
TABLE_HEADING = "## Options (`kvcached.config.OPTIONS`)"
_COLUMNS = ("Option", "Environment variable", "Values", "Default", "Read by", "Meaning")
_BINARY_UNITS = ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB"))


def _shown_value(option: Option, value: object) -> str:
    """A default as a user would write it: ``true``, ``256MiB``, ``5``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int) and isinstance(option.parse, Size) and value:
        for shift, unit in _BINARY_UNITS:
            if value % (1 << shift) == 0:
                return f"{value >> shift}{unit}"
    return str(value)


def default_cell(option: Option) -> str:
    """The Default column: the value, or what being unset means."""
    if option.default is None:
        return f"unset: {option.default_note}"
    shown = f"`{_shown_value(option, option.default)}`"
    return f"{shown} ({option.default_note})" if option.default_note else shown


def options_table() -> str:
    """The Markdown table of every option, in the table's order."""
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for name, option in OPTIONS.items():
        values = describe(option.parse) or ""
        variables = ", ".join(f"`{env}`" for env in (option.env, *option.aliases))
        cells = (f"`{name}`", variables, values, default_cell(option), option.read_by, option.doc)
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(lines) + "\n"


def _table_span(document: str) -> tuple[int, int]:
    """Where the table after :data:`TABLE_HEADING` starts and ends in ``document``."""
    heading = document.index(TABLE_HEADING)
    start = document.index("\n|", heading) + 1
    end = document.find("\n\n", start)
    return start, (len(document) if end < 0 else end + 1)


def documented_table(document: str) -> str:
    """The options table as ``document`` has it."""
    start, end = _table_span(document)
    return document[start:end]


def with_table(document: str) -> str:
    """``document`` with its options table replaced by the generated one."""
    start, end = _table_span(document)
    return document[:start] + options_table() + document[end:]


@quiet_on_broken_pipe
def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcached.config_doc", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, metavar="PATH", help="replace the table in PATH")
    group.add_argument("--check", type=Path, metavar="PATH", help="exit 1 if PATH's table differs")
    args = parser.parse_args(argv)
    if args.write:
        args.write.write_text(with_table(args.write.read_text()))
        return 0
    if args.check:
        if documented_table(args.check.read_text()) != options_table():
            print(
                f"{args.check}: the options table differs from kvcached.config.OPTIONS; "
                f"run python -m kvcached.config_doc --write {args.check}",
                file=sys.stderr,
            )
            return 1
        return 0
    sys.stdout.write(options_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
