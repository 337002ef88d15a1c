"""Keeps an engine that computes on the CPU from giving its heap back and taking it again every step.

Rationale: an engine on the CPU (SGLang's CPU build) allocates its model's
temporaries from glibc's heap each step and frees them after it. glibc gives
the free top of its heap back to the system once it exceeds a trim threshold
(which glibc adjusts as the process runs), and the next step
faults the same memory in again, page by page. Whether that happens depends on
what lies at the heap's top. SGLang's scheduler with kvcached took about
250 000 minor page faults a pass, against about 2 000 without kvcached
(``bench/e2e/sglang_e2e_paired.py``, ``bench/RESULTS.md``); SGLang's own slot
allocator replaces a free-list tensor at every cache flush, and the same
allocation made by kvcached's allocator also stopped the trimming in an
experiment. But SGLang without kvcached trimmed the same way in three of six
engine pairs: it is a matter of where glibc's heap top lies, so the remedy
is glibc's setting, not an allocation placed by luck. vLLM's CPU worker is the
same kind of process: in-process, kvcached's engine took about 180 faults a
step more than vLLM's own, with no page mapped, and vLLM's own engines trim
too, some more than others (``bench/e2e/vllm_e2e_paired.py --lockstep``).

Approach: fix glibc's trim threshold at ``keep_bytes`` (freed heap memory up
to that much stays with the process for its next step) and its mmap threshold
at glibc's own dynamic ceiling (32 MiB on 64-bit), since fixing either stops
glibc from adjusting both.

Limitations: glibc only (``mallopt``); a process whose malloc is another
(tcmalloc or jemalloc preloaded, musl) is left as it is. Process-wide, for the
rest of the process's life. The KV cache itself is not on this heap: it stays
elastic.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Optional

from kvcached.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

#: mallopt parameters (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: glibc's dynamic mmap threshold never rises above this on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX).
GLIBC_MMAP_THRESHOLD_MAX_BYTES = 32 << 20
#: mallopt takes an int.
_INT_MAX = 2**31 - 1


def _glibc() -> Optional[ctypes.CDLL]:
    """glibc, its mallopt typed, or None under another C library.

    A preloaded tcmalloc or jemalloc is not detected: glibc's settings then go unused.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018 (only glibc has it)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return libc


def keep_freed_heap(keep_bytes: int, log: Optional[logging.Logger] = None) -> bool:
    """Lets glibc keep up to ``keep_bytes`` of freed heap memory instead of trimming it.

    Returns whether glibc took the settings; False (and nothing changed) with
    ``keep_bytes`` 0 or without glibc. Raises ValueError for a negative size.
    ``log``: where to say so (the engine's own logger, whose output the engine shows).
    """
    log = log or logger
    if keep_bytes < 0:
        raise InvalidArgumentError(f"keep_bytes must be >= 0, got {keep_bytes}")
    if keep_bytes == 0:
        return False
    libc = _glibc()
    if libc is None:
        log.info("kvcached: not glibc's malloc; the heap's trimming is left as it is")
        return False
    trim = min(keep_bytes, _INT_MAX)
    if not (libc.mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX_BYTES) and libc.mallopt(M_TRIM_THRESHOLD, trim)):
        log.warning("kvcached: glibc refused mallopt (trim threshold %d bytes)", trim)
        return False
    log.info(
        "kvcached: this process keeps up to %d MiB of freed heap memory (KVCACHED_HOST_HEAP_KEEP_BYTES)", trim >> 20
    )
    return True


__all__ = ["GLIBC_MMAP_THRESHOLD_MAX_BYTES", "keep_freed_heap"]
