"""bench/e2e/vllm_e2e.py's step timer: its wrappers keep the signatures kvcached checks."""

from __future__ import annotations

import inspect

from vllm_e2e import StepTimer


def _update_from_output(self, scheduler_output, model_runner_output):
    return scheduler_output, model_runner_output


def test_timed_methods_keep_the_signature_kvcached_verifies():
    """kvcached refuses to patch a vLLM method whose parameters moved, reading them
    through ``inspect.unwrap``: a timed method must still show the original ones."""
    for timed in (StepTimer._timed(_update_from_output, "x_s", cpu=True), StepTimer._timed_worker(_update_from_output)):
        assert list(inspect.signature(inspect.unwrap(timed)).parameters) == [
            "self",
            "scheduler_output",
            "model_runner_output",
        ]
        assert timed(None, 1, 2) == (1, 2)
