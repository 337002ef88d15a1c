"""Test infrastructure for running SGLang on a CPU (not part of kvcached).

Python imports ``sitecustomize`` at start-up from ``sys.path``; the SGLang
tests put this folder on ``PYTHONPATH``, so every process SGLang spawns
(schedulers, detokenizer, HTTP server) gets the torchvision shim and finds the
``sgl_kernel`` import stub next to it, with no change to the environment.
"""

import _tv_cpu_shim

_tv_cpu_shim.install()
