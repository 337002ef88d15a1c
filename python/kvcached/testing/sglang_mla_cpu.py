"""DeepSeek-style MLA on SGLang 0.5.23's CPU engine: the absorbed MLA path for every batch.

SGLang runs a DeepSeek prefill without a cached prefix in its "MHA" form
(``handle_attention_triton``, which the ``torch_native`` backend falls back to)
and the decode in its absorbed "MLA" form. On the CPU engine the MHA form fails,
without kvcached: ``torch_native`` reads the 576-wide latent cache as 96-wide
keys ("RuntimeError: Expected size for first two dimensions of batch2 tensor to
be: [4, 96] but got: [4, 576]"). Registering the absorbed form for
``torch_native`` (what SGLang does for AMX CPUs) lets MLA models run there; the
tests do so in every engine they compare, with kvcached and without.
"""

from __future__ import annotations

import os

#: Set in an engine's environment to take the absorbed MLA path on ``torch_native``.
ENV = "KVCACHED_TEST_SGLANG_ABSORBED_MLA"


def use_absorbed_mla_on_torch_native() -> None:
    """Has DeepSeek-style attention take the absorbed MLA path on ``torch_native`` in this process."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)


def apply_from_env() -> None:
    """:func:`use_absorbed_mla_on_torch_native` when :data:`ENV` is ``1`` (in every SGLang process)."""
    if os.environ.get(ENV) == "1":
        use_absorbed_mla_on_torch_native()


__all__ = ["ENV", "apply_from_env", "use_absorbed_mla_on_torch_native"]
