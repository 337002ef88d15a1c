"""Test infrastructure for running SGLang on a CPU (not part of kvcached): a torchvision shim.

SGLang imports torchvision unconditionally. PyPI's torchvision 0.28.0 links
libtorch_cuda, so beside torch 2.13.0+cpu its C++ ops never load and its
``_meta_registrations`` dies on ``torchvision::nms does not exist``. This
defines the two op schemas (no kernels) right before torchvision is first
imported. Installed by ``sitecustomize`` in this folder.
"""

import importlib.abc
import sys


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            for op in ("nms", "qnms"):
                try:
                    lib.define(op + "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                except RuntimeError:  # already defined (a real torchvision build loaded it)
                    pass
            globals()["_lib"] = lib
        return None


def install() -> None:
    if not any(isinstance(finder, _Finder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
