"""Which SGLang 0.5.23 KV pool families kvcached backs, and why the others are refused.

kvcached backs a pool family only where it has served it inside SGLang: greedy
outputs identical with and without kvcached, memory following the load. Families
whose models SGLang's CPU build cannot run without kvcached are refused by name,
with the error that build gives, so that SGLang runs them on its own pools.

* Plain attention (``MHATokenToKVPool``): Llama-like models, and Gemma 2 / 3,
  for which SGLang turns its SWA pool off ("Disable hybrid SWA memory for
  Gemma3ForCausalLM as it is not yet supported"): every layer, sliding ones
  too, keeps every token, and all of it is elastic.
* Hybrid SWA (``SWAKVPool``): refused. gpt-oss, Gemma 4 and Llama 4 refuse
  SGLang's only CPU attention backend here (``torch_native``).
* Hybrid linear / Mamba state (``HybridLinearKVPool`` + ``MambaPool``): refused.
  SGLang's linear-attention backend needs sgl-kernel's CPU Mamba ops.
"""

from __future__ import annotations

from typing import Any

#: The hybrid SWA pool: what SGLang's CPU build says when asked to run its models.
SWA_POOL_REFUSAL = (
    "SGLang's hybrid SWA KV pool (SWAKVPool: gpt-oss, Gemma 4, Llama 4, ...), which kvcached does not "
    "back yet: SGLang 0.5.23's CPU build runs none of these models (\"GptOssForCausalLM requires one of "
    "['triton', 'trtllm_mha', 'fa3', 'fa4', 'ascend', 'intel_amx', 'intel_xpu', 'aiter'] attention "
    'backend", "Gemma4 only supports trtllm_mha, triton, fa4, ascend, intel_xpu, intel_amx, or aiter '
    'attention backend, got prefill=torch_native"), so an elastic SWA pool has never been checked'
)

#: The hybrid linear / Mamba state pool (Gated DeltaNet, Mamba2).
MAMBA_POOL_REFUSAL = (
    "SGLang's hybrid linear / Mamba state pool (HybridLinearKVPool and MambaPool: Qwen3-Next, Granite 4.0 "
    "hybrid, Nemotron-H, ...), which kvcached does not back yet: SGLang 0.5.23's CPU build cannot run these "
    "models without sgl-kernel's CPU ops (\"No module named 'sgl_kernel.mamba'\", from its linear-attention "
    "backend), so an elastic state pool has never been checked"
)


def family_refusals(configurator: Any) -> list[str]:
    """The pool families of this engine that kvcached refuses (empty: it backs them all)."""
    found = []
    if configurator.is_hybrid_swa:
        found.append(SWA_POOL_REFUSAL)
    if configurator.mambaish_config is not None:
        found.append(MAMBA_POOL_REFUSAL)
    return found


__all__ = ["MAMBA_POOL_REFUSAL", "SWA_POOL_REFUSAL", "family_refusals"]
