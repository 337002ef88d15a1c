#!/usr/bin/env bash
# Installs the pinned SGLang's Python runtime into a new virtual environment VENV on a
# GPU-less x86-64 machine, beside the pinned torch's CPU build, for the SGLang integration
# tests. SGLang's requirement list pins a CUDA stack (torch 2.14.1, sglang-kernel,
# flashinfer, ...), so sglang and the few packages that would pull a CUDA torch
# are installed with --no-deps and the rest is listed here, pinned where it
# mattered. python/kvcached/testing/sglang_cpu/ provides the sgl_kernel import stub and
# the torchvision shim at run time (through PYTHONPATH; nothing here).
set -euo pipefail
VENV=${1:?usage: install_sglang_cpu.sh VENV}
# TORCH_VERSION and SGLANG_VERSION, written only there.
# shellcheck source=../python/kvcached/integration/common/engine_pins.env
source "$(dirname "$0")/../python/kvcached/integration/common/engine_pins.env"
python3 -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q "torch==$TORCH_VERSION+cpu"
"${PIP[@]}" install -q --no-deps "sglang==$SGLANG_VERSION" triton==3.9.0 xgrammar==0.2.7 torchvision==0.28.0
"${PIP[@]}" install -q aiohttp fastapi "uvicorn>=0.51" uvloop orjson "pyzmq>=25.1.2" msgspec psutil \
  setproctitle pybase64 pydantic requests tqdm numpy scipy transformers==5.19.0 tokenizers==0.23.2 \
  safetensors einops interegular partial_json_parser python-multipart "prometheus-client>=0.20.0" \
  packaging xxhash zstandard pillow sentencepiece==0.2.1 tiktoken openai==2.8.0 openai-harmony==0.0.4 \
  gguf "llguidance>=1.7.6,<2" distro watchfiles blobfile "python-dateutil<3" numba==0.65.1 ninja \
  apache-tvm-ffi==0.1.11 nvidia-ml-py dill compressed-tensors==0.18.0 IPython jsonschema soundfile
# kvcached's build and test tools
"${PIP[@]}" install -q nanobind scikit-build-core cmake pytest hypothesis pytest-benchmark rich
"$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION'), torch.__version__"
