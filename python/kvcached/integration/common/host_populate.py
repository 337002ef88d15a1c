"""Host pages of an engine whose ranks share the machine's CPUs are populated on touch.

Rationale: with ``KVCACHED_HOST_POPULATE=background`` (the default) each
process populates its new host pages on a thread that runs on every CPU
beside its caller's (``cpp/src/host/host_populator.cpp``). An engine whose
ranks compute on the CPU (SGLang's tensor and pipeline ranks, its data-parallel
replicas) binds each rank to cores of its own, so that thread runs on another
rank's core, and every rank then waits for the slowest at its collectives. On
the 2-core development VM a TP=2 SGLang engine with kvcached read 0.915× the
output tokens/s of SGLang without it with ``background`` (30 passes), and
1.041× and 0.910× in two 30-pass runs with ``on_touch`` (``bench/RESULTS.md``):
too noisy to show the gain, so the reason above is what decides.

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
        "kvcached: host pages are populated on touch (%s=on_touch): this engine's %d ranks each "
        "compute on their own CPUs, and populating in the background would run on another rank's.",
        _OPTION,
        num_ranks,
    )
    return True
