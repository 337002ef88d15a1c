"""Which kvcached device an engine's torch device is (the one place integrations map them).

PyTorch names every GPU ``cuda``, also AMD GPUs under its ROCm build
(``torch.version.hip`` set). kvcached opens those with its HIP backend
(``hip:N``) and keeps their registry under ``rocm:N``.
"""

from __future__ import annotations

from typing import Any


def kvcached_device_name(device: Any, *, registry: bool = False) -> str:
    """kvcached's name of a torch device: "cpu", "cuda:N" or "hip:N" (registry: "rocm:N").

    ``device`` is anything ``torch.device`` accepts; a GPU without an index
    means the process's current one.
    """
    # TODO(devices): switch to kvcached.devices' canonical device-name helpers
    # once they exist, so the registry and the backends spell devices alike.
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"kvcached has no backend for torch device {device}")
    kind = "cuda"
    if getattr(torch.version, "hip", None):  # PyTorch's ROCm build: an AMD GPU
        kind = "rocm" if registry else "hip"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"{kind}:{index}"


__all__ = ["kvcached_device_name"]
