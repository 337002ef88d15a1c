"""Whether an engine argument sets one of the flags ``kvcached serve`` decides itself, as the engine reads it.

Serve gives every engine ``--host``, ``--port``, the model and its served name; an argument in a
model's ``args`` that set one of them would move the engine out from behind the router (``--host
0.0.0.0``) or off the port the router uses. The engines' parsers read more spellings than the flag:
argparse takes any unambiguous abbreviation (``--hos``, ``--po``; neither vLLM nor SGLang turns that
off), vLLM's parser reads ``_`` as ``-`` (``--served_model_name``) and ``--flag.key`` as a part of
``--flag``, and ``--flag=value`` is the flag. Neither engine defines a short alias (``-p``) for these
flags, so single-dash words are left alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional


def owned_flag(word: str, owned: Iterable[str]) -> Optional[str]:
    """The flag of ``owned`` that command-line word ``word`` would set in the engine, or None."""
    if not word.startswith("--"):
        return None
    name = word.split("=", 1)[0].split(".", 1)[0].rstrip("+").replace("_", "-")
    if len(name) <= 2:  # "--" alone ends the options
        return None
    owned = tuple(owned)
    if name in owned:
        return name
    # An abbreviation argparse would expand to the flag (an ambiguous one fails the engine anyway).
    return next((flag for flag in owned if flag.startswith(name)), None)


__all__ = ["owned_flag"]
