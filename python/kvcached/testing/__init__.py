"""Support shared by kvcached's tests, benchmarks and examples (like ``numpy.testing``).

- :mod:`kvcached.testing.tiny_llama`: a tiny random-weight Llama written from a seed
  (nothing downloaded) and deterministic token-id prompts.
- :mod:`kvcached.testing.sglang_env`: SGLang's Python runtime on a CPU, in this process
  and the ones it starts (the import stub and torchvision shim in ``sglang_cpu/``).

Nothing here is imported by kvcached itself; the modules import their heavy
dependencies (torch, transformers, pytest) only when called.
"""
