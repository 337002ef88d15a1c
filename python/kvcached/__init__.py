"""kvcached: an elastic KV cache for LLM serving.

An engine reserves a large *virtual* KV cache; physical memory is mapped in
only while blocks are in use, so several engines share one device elastically.
Backends: CUDA (driver VMM API), HIP, and host memory with the same semantics.
"""

from __future__ import annotations

from kvcached import configured, defaults, geometry, registry, tensor_views
from kvcached.devices import BackendStatus, backends, default_device, open_device, parse_device
from kvcached.errors import (
    BackendUnavailableError,
    ConfigurationError,
    DeviceOutOfMemoryError,
    DriverError,
    InvalidArgumentError,
    KvcachedError,
    OutOfMemoryError,
)
from kvcached.layout import BlockManagerOptions, KVLayout, KVSpaceOptions, Mirror
from kvcached.manager import KVCacheManager
from kvcached.pool import BlockManager, KVPool, KVSpace, PageOps
from kvcached.weights import ModelWeights

__version__ = "0.1.0"

# The core is given its defaults from here, above it: the options, and a pool registered in its
# device's registry (kvcached/defaults.py says why the core never reads them itself).
defaults.install(configured.ConfiguredDefaults(pool_budget=registry.register_pool))

__all__ = [
    "BackendStatus",
    "geometry",
    "tensor_views",
    "BackendUnavailableError",
    "BlockManager",
    "BlockManagerOptions",
    "ConfigurationError",
    "DeviceOutOfMemoryError",
    "DriverError",
    "InvalidArgumentError",
    "KVCacheManager",
    "KVLayout",
    "KVPool",
    "KVSpace",
    "KVSpaceOptions",
    "KvcachedError",
    "Mirror",
    "ModelWeights",
    "OutOfMemoryError",
    "PageOps",
    "backends",
    "default_device",
    "open_device",
    "parse_device",
    "__version__",
]
