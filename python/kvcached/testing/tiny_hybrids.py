"""Tiny random-weight hybrid models (several vLLM KV cache groups) for the vLLM integration tests.

Each family is written by transformers from a fixed seed (no download), with
the tiny Llama's vocabulary so that ``tiny_llama.prompt_ids`` prompts fit.
Sizes keep a 2 MiB kvcached page a handful of 128-token blocks, so memory
visibly follows load, and the models fast enough for two CPU cores.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from kvcached.errors import InvalidArgumentError
from kvcached.testing.tiny_llama import TINY_LLAMA

#: Standard deviation of every weight matrix (conv kernels aside) of a tiny model.
WEIGHT_STD = 0.08
#: Families whose embeddings are drawn smaller: Gemma multiplies them by sqrt(hidden_size) = 16 and
#: reads its logits through them, so at the common scale the embedding dominates the residual
#: stream and the model repeats its last token whatever its KV cache holds.
_EMBEDDING_STD = {name: WEIGHT_STD / 16 for name in ("gemma3", "gemma3_attending", "gemma3_all_full", "gemma4")}

#: Tokens a sliding-window layer keeps: one 128-token block (vLLM keeps the blocks the window touches).
SLIDING_WINDOW = 128

_COMMON = dict(
    vocab_size=TINY_LLAMA["vocab_size"],
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=64,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _gemma3(sliding: bool = True) -> tuple[Any, Any]:
    """Gemma 3 text: five sliding-window layers to one full-attention layer (or all full), with
    tied embeddings as Gemma 3 ships (SGLang ties them whatever the config says)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    first = "sliding_attention" if sliding else "full_attention"
    config = Gemma3TextConfig(
        **{**_COMMON, "tie_word_embeddings": True},
        num_hidden_layers=6,
        sliding_window=SLIDING_WINDOW,
        query_pre_attn_scalar=64,
        layer_types=[first] * 5 + ["full_attention"],
    )
    return config, Gemma3ForCausalLM


def _gpt_oss() -> tuple[Any, Any]:
    """gpt-oss: alternating sliding-window and full attention, attention sinks, MoE."""
    from transformers import GptOssConfig, GptOssForCausalLM

    common = {k: v for k, v in _COMMON.items() if k != "intermediate_size"}
    config = GptOssConfig(
        **common,
        intermediate_size=256,
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    return config, GptOssForCausalLM


def _qwen3_next() -> tuple[Any, Any]:
    """Qwen3-Next: Gated DeltaNet linear attention (head dim 128) and full attention, MoE."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(
        **{**_COMMON, "num_key_value_heads": 2},
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        full_attention_interval=4,  # SGLang places the full-attention layers by it
        linear_conv_kernel_dim=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        num_experts=4,
        num_experts_per_tok=2,
    )
    return config, Qwen3NextForCausalLM


def _granite_hybrid() -> tuple[Any, Any]:
    """Granite 4.0 hybrid: Mamba2 layers and attention layers."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    config = GraniteMoeHybridConfig(
        **{k: v for k, v in _COMMON.items() if k != "head_dim"},
        num_hidden_layers=4,
        layer_types=["mamba", "mamba", "mamba", "attention"],
        mamba_n_heads=8,
        mamba_d_head=64,
        mamba_d_state=64,
        mamba_n_groups=1,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        num_local_experts=0,
        shared_intermediate_size=512,
        position_embedding_type="rope",
    )
    return config, GraniteMoeHybridForCausalLM


def _deepseek_v2() -> tuple[Any, Any]:
    """DeepSeek-V2 style multi-head latent attention: a 512 latent + 64 rope cell per token
    (vLLM's CPU MLA decode kernel takes only 576-wide cells, a 512 value head and 16-token blocks;
    SGLang's CPU rotary embedding for MLA takes only DeepSeek's YaRN, here with factor 1)."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    common = {k: v for k, v in _COMMON.items() if k not in ("head_dim", "num_key_value_heads")}
    config = DeepseekV2Config(
        **common,
        num_key_value_heads=4,
        num_hidden_layers=2,
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_nope_head_dim=32,
        qk_rope_head_dim=64,
        v_head_dim=512,
        first_k_dense_replace=2,
        n_routed_experts=4,
        n_shared_experts=1,
        moe_intermediate_size=128,
        num_experts_per_tok=2,
        # DeepSeek-V2-Lite's routing fields, which SGLang reads and transformers no longer defines
        moe_layer_freq=1,
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=False,
        scoring_func="softmax",
        rope_scaling={
            "rope_type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": _COMMON["max_position_embeddings"],
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    return config, DeepseekV2ForCausalLM


def _llama4() -> tuple[Any, Any]:
    """Llama 4 text: chunked local attention (128-token chunks) in three layers of four,
    the fourth a global layer without RoPE; MoE in every layer."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        **{k: v for k, v in _COMMON.items() if k != "intermediate_size"},
        intermediate_size=256,
        intermediate_size_mlp=512,
        num_hidden_layers=4,
        num_local_experts=4,
        num_experts_per_tok=1,
        attention_chunk_size=SLIDING_WINDOW,
        no_rope_layers=[1, 1, 1, 0],  # 0: a global layer (no RoPE, no chunking)
        use_qk_norm=False,
        attn_temperature_tuning=False,
    )
    return config, Llama4ForCausalLM


def _gemma4() -> tuple[Any, Any]:
    """Gemma 4 text: the last two of six layers read the KV cache of earlier layers
    (cross-layer KV sharing, ``num_kv_shared_layers``), sliding and full attention."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        **{k: v for k, v in _COMMON.items() if k != "tie_word_embeddings"},
        num_hidden_layers=6,
        sliding_window=SLIDING_WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 3,
        num_kv_shared_layers=2,
        global_head_dim=64,  # full-attention layers' head (512 by default)
        vocab_size_per_layer_input=TINY_LLAMA["vocab_size"],
        hidden_size_per_layer_input=64,
    )
    return config, Gemma4ForCausalLM


#: Whisper's special tokens, first in its tiny vocabulary (ids 0-8); a decoder prompt transcribes.
WHISPER_SPECIAL = (
    "<|endoftext|>",
    "<|startoftranscript|>",
    "<|en|>",
    "<|transcribe|>",
    "<|translate|>",
    "<|notimestamps|>",
    "<|nocaptions|>",
    "<|startoflm|>",
    "<|startofprev|>",
)
WHISPER_DECODER_PROMPT = [1, 2, 3, 5]  # <|startoftranscript|><|en|><|transcribe|><|notimestamps|>


def _whisper_processor() -> Any:
    """A tiny byte-level BPE tokenizer with Whisper's special tokens and Whisper's feature extractor
    (vLLM's Whisper needs both, even for token-id prompts)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import WhisperFeatureExtractor, WhisperProcessor, WhisperTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(WHISPER_SPECIAL), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 8, trainer)
    end = WHISPER_SPECIAL[0]
    fast = WhisperTokenizerFast(tokenizer_object=tokenizer, unk_token=end, bos_token=end, eos_token=end, pad_token=end)
    return WhisperProcessor(feature_extractor=WhisperFeatureExtractor(feature_size=80), tokenizer=fast)


def _whisper() -> tuple[Any, Any]:
    """Whisper: an audio encoder and a text decoder whose cross attention reads the encoder's
    1500 positions (vLLM's CrossAttentionSpec: 12 blocks of 128 per request)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=len(_whisper_processor().tokenizer),
        d_model=256,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=512,
        decoder_ffn_dim=512,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=448,
        decoder_start_token_id=1,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return config, WhisperForConditionalGeneration


def whisper_audio(seconds: float, seed: int) -> Any:
    """A deterministic noise clip of ``seconds`` at Whisper's 16 kHz, as vLLM takes audio: (samples, rate)."""
    import numpy as np

    rate = 16000
    return (np.random.default_rng(seed).standard_normal(int(seconds * rate)).astype(np.float32) * 0.1, rate)


FAMILIES: dict[str, Callable[[], tuple[Any, Any]]] = {
    "gemma3": _gemma3,
    "gemma3_attending": _gemma3,  # the same model, by the name SGLang's tests and benchmark use
    "gemma3_all_full": lambda: _gemma3(sliding=False),  # the same model, every layer at full attention
    "gpt_oss": _gpt_oss,
    "qwen3_next": _qwen3_next,
    "granite_hybrid": _granite_hybrid,
    "deepseek_v2": _deepseek_v2,
    "llama4": _llama4,
    "gemma4": _gemma4,
    "whisper": _whisper,
}


def make_tiny_hybrid(family: str, path: str | os.PathLike, seed: int = 0) -> str:
    """Writes the tiny random-weight checkpoint of ``family`` to ``path`` (once) and returns it."""
    path = Path(path)
    if (path / "config.json").exists():
        return str(path)
    import torch

    config, model_class = FAMILIES[family]()
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = model_class(config)
    # As the tiny Llama: larger weights keep greedy decoding off near-ties.
    embedding_std = _EMBEDDING_STD.get(family, WEIGHT_STD)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2 and "conv" not in name:
                p.normal_(0.0, embedding_std if "embed_tokens" in name else WEIGHT_STD)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if family == "whisper":
        _whisper_processor().save_pretrained(path)
    return str(path)


def with_context_changed(prompts: list[list[int]]) -> list[list[int]]:
    """``prompts`` and, last, the second with the first's last token: that token in another context,
    so that greedy outputs show whether a model reads its KV cache (see
    :func:`check_outputs_read_context`)."""
    if prompts[0][-1] == prompts[1][-1]:
        raise InvalidArgumentError("the first two prompts end in the same token: pass prompts that end differently")
    return [*prompts, prompts[1][:-1] + prompts[0][-1:]]


def check_outputs_read_context(outputs: list[list[int]]) -> None:
    """Raises ``AssertionError`` unless the greedy outputs of :func:`with_context_changed`'s prompts
    depend on context: identical outputs with and without kvcached prove its pages right only if
    the model reads them (a tiny random model may repeat its last token whatever they hold)."""
    assert any(len(set(tokens)) > 2 for tokens in outputs), f"every output repeats a token or two: {outputs}"
    assert outputs[0] != outputs[-1], f"the same last token in another context gave the same output: {outputs}"


__all__ = [
    "FAMILIES",
    "SLIDING_WINDOW",
    "WHISPER_DECODER_PROMPT",
    "check_outputs_read_context",
    "make_tiny_hybrid",
    "whisper_audio",
    "with_context_changed",
]
