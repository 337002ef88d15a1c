"""Support shared by kvcached's tests, benchmarks and examples (like ``numpy.testing``).

- :mod:`kvcached.testing.tiny_llama`: a tiny random-weight Llama written from a seed
  (nothing downloaded) and deterministic token-id prompts.
- :mod:`kvcached.testing.sglang_env`: SGLang's Python runtime on a CPU, in this process
  and the ones it starts (the import stub and torchvision shim in ``sglang_cpu/``).
- :mod:`kvcached.testing.serve_session`: one ``kvcached serve`` process (config, log, health,
  ``/metrics``, SIGTERM) and its registry's entries.

Nothing here is imported by kvcached itself; the modules import their heavy
dependencies (torch, transformers, pytest) only when called.
"""
