"""kvcached: an elastic KV cache for LLM serving.

An engine reserves a large *virtual* KV cache; physical memory is mapped in
only while blocks are in use, so several engines share one device elastically.
Backends: CUDA (driver VMM API), HIP, and host memory with the same semantics.
"""

from __future__ import annotations

from kvcached.devices import BackendStatus, backends, default_device, open_device, parse_device
from kvcached.errors import (
    BackendUnavailableError,
    DeviceOutOfMemoryError,
    DriverError,
    KvcachedError,
    OutOfMemoryError,
)

__version__ = "0.1.0"

__all__ = [
    "BackendStatus",
    "BackendUnavailableError",
    "DeviceOutOfMemoryError",
    "DriverError",
    "KvcachedError",
    "OutOfMemoryError",
    "backends",
    "default_device",
    "open_device",
    "parse_device",
    "__version__",
]
