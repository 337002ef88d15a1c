"""Test infrastructure for running SGLang on a CPU (not part of kvcached): an sgl_kernel import stub.

Pure-torch stand-ins for the few sgl_kernel CPU ops that SGLang imports at module level
when SGLANG_USE_CPU_ENGINE=1, so SGLang's Python runtime runs on a CPU without the
(source-only, AVX512/AMX-oriented) sgl-kernel CPU build. Any other symbol resolves to a
callable that raises, so an unexpected call is loud rather than silently wrong."""

import ctypes
import os
import sys

import torch  # noqa: F401  (as the recipe it comes from had it)

_TRACE = os.environ.get("SGL_KERNEL_STUB_TRACE") == "1"


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    # Row i of the batch gets out_cache_loc[off_i : off_i + (end_i - start_i)]
    # written to req_to_token[req_pool_indices[i], start_i:end_i].
    if _TRACE:
        print("[sgl_kernel stub] CALL assign_req_to_token_pool_cpu", file=sys.stderr)
    off = 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        n = e - s
        if n > 0:
            req_to_token[r, s:e] = out_cache_loc[off : off + n].to(req_to_token.dtype)
        off += n


def copy_all_layer_kv_cache_cpu(data_ptrs, strides, tgt_loc, src_loc):
    # For every buffer (raw base pointer + row stride in bytes) copy row src -> row tgt.
    if _TRACE:
        print("[sgl_kernel stub] CALL copy_all_layer_kv_cache_cpu", file=sys.stderr)
    for ptr, stride in zip(data_ptrs.tolist(), strides.tolist()):
        for t, s in zip(tgt_loc.tolist(), src_loc.tolist()):
            ctypes.memmove(ptr + t * stride, ptr + s * stride, stride)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    if _TRACE:
        print(f"[sgl_kernel stub] imported {name}", file=sys.stderr)

    def _missing(*a, **k):
        raise NotImplementedError(f"sgl_kernel stub: {name} is not implemented")

    _missing.__name__ = name
    return _missing
