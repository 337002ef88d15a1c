"""A tiny random-weight Llama and token-id prompts, shared by tests, benchmarks and examples.

Written by transformers from a fixed seed, so no download is needed; every engine
(vLLM, SGLang, in their own environments) loads the same checkpoint. The engine tests
use it as is; the end-to-end benchmarks take more layers in bf16.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

# Small enough to run on two CPU cores, big enough that one 2 MiB kvcached page
# holds few tokens: 4 KV heads x 64 x fp32 = 1 KiB per token and layer for K,
# as much for V. A page holds 2048 tokens of SGLang's K (or V) buffer and 1024
# tokens of vLLM's K||V cells, so memory visibly follows load.
TINY_LLAMA = dict(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)


def make_tiny_llama(path: str | os.PathLike, seed: int = 0, *, layers: int = 2, dtype: str = "float32") -> str:
    """Writes a random-weight Llama checkpoint to ``path`` (once) and returns it.

    ``layers`` replaces :data:`TINY_LLAMA`'s layer count; ``dtype`` (a torch dtype
    name) is the checkpoint's. A directory that already holds a ``config.json`` is
    returned as it is.
    """
    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY_LLAMA, "num_hidden_layers": layers}, torch_dtype=dtype)
    model = LlamaForCausalLM(config)
    # Larger weights than the default init make greedy decoding less likely
    # to sit on near-ties, so that token-level comparisons are meaningful.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    path.mkdir(parents=True, exist_ok=True)
    model.to(getattr(torch, dtype)).save_pretrained(path, safe_serialization=True)
    return str(path)


def prompt_ids(n: int, length: int, seed: int = 1, shared_prefix: int = 0) -> list[list[int]]:
    """``n`` deterministic prompts of ``length`` token ids; the first
    ``shared_prefix`` tokens are the same in all of them (prefix-cache hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(shared_prefix)]
    return [
        prefix + [rng.randrange(3, TINY_LLAMA["vocab_size"]) for _ in range(length - shared_prefix)] for _ in range(n)
    ]
