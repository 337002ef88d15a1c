"""Host pages of an engine whose ranks share the machine's CPUs are populated on touch.

Rationale: with ``KVCACHED_HOST_POPULATE=background`` (the default) a process
whose mapping thread is bound to some of the CPUs populates its new host pages
on a thread that runs on every CPU beside those (``cpp/src/host/host_populator.cpp``).
SGLang binds each CPU rank (tensor or pipeline rank, data-parallel replica) to
cores of its own where its CPU kernels are built (AMX or arm64,
``SGLANG_CPU_OMP_THREADS_BIND``): there that thread would run on the other
ranks' cores, and every rank waits for the slowest at its collectives. Where
SGLang does not bind its ranks (the 2-core development VM has no AMX) no such
thread starts and both ways fault pages in on first write alike. Not measured
on a machine where SGLang binds its ranks.

Approach: before the engine opens the host device, a process that is one of
several such ranks sets ``KVCACHED_HOST_POPULATE=on_touch`` for itself, unless
the user set the option: the rank's own forward pass faults its pages in.
"""

from __future__ import annotations

import logging
import os

__all__ = ["populate_on_touch_beside_sibling_ranks"]

_OPTION = "KVCACHED_HOST_POPULATE"


def populate_on_touch_beside_sibling_ranks(num_ranks: int, logger: logging.Logger) -> bool:
    """Choose ``on_touch`` for this process when it is one of ``num_ranks`` > 1 CPU-bound ranks.

    Returns True when it chose; False when one rank, or when the user set the
    option (their choice stands). Call before the host device is opened: the
    option is read then.
    """
    if num_ranks <= 1 or _OPTION in os.environ:
        return False
    os.environ[_OPTION] = "on_touch"
    logger.info(
        "kvcached: host pages are populated on touch (%s=on_touch): this engine's %d ranks share the "
        "machine's CPUs, and populating in the background would run on another rank's.",
        _OPTION,
        num_ranks,
    )
    return True
