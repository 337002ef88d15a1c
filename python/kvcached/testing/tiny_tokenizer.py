"""A byte-level tokenizer for the tiny models, so that engines' text endpoints work without a download.

The tiny Llama (:mod:`kvcached.testing.tiny_llama`) has a 512-token vocabulary and no tokenizer;
the engine tests send token ids. OpenAI-style endpoints (``/v1/completions`` with text,
``/v1/chat/completions``) need a tokenizer and a chat template, so this writes one beside a
checkpoint: ids 0-2 are ``<pad> <s> </s>``, the next 256 are the bytes (GPT-2's byte-level
alphabet, so every text encodes), and the rest of the vocabulary are two-letter tokens that
encoding never produces but that decode to text, so any id a random model picks reads as text.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvcached.testing.tiny_llama import TINY_LLAMA

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
# A plain template: role tags, then the assistant's turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order (what ``ByteLevel`` uses)."""
    from tokenizers.pre_tokenizers import ByteLevel

    return sorted(ByteLevel.alphabet(), key=lambda ch: _byte_of(ch))


def _byte_of(ch: str) -> int:
    # The inverse of GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves,
    # the others were shifted up past 255 in byte order.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    code = ord(ch)
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]


def write_tiny_tokenizer(path: str | os.PathLike, vocab_size: int = TINY_LLAMA["vocab_size"]) -> str:
    """Writes the tokenizer (``tokenizer.json``, its config, the chat template) into ``path`` (a
    checkpoint directory) once, and returns ``path``."""
    path = Path(path)
    if (path / "tokenizer.json").exists():
        return str(path)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = _byte_alphabet()
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
    pairs = (a + b for a in letters for b in letters)
    while len(vocab) < vocab_size:
        vocab.setdefault(next(pairs), len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", model_max_length=4096
    )
    fast.chat_template = CHAT_TEMPLATE
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(path)
    return str(path)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvcached.testing.tiny_tokenizer DIR``: writes the tiny Llama and this tokenizer to DIR."""
    import argparse

    from kvcached.testing.tiny_llama import make_tiny_llama

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("path", help="the checkpoint directory to write (kept if it exists)")
    path = parser.parse_args(argv).path
    write_tiny_tokenizer(make_tiny_llama(path))
    print(path)


__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "write_tiny_tokenizer"]

if __name__ == "__main__":
    main()
