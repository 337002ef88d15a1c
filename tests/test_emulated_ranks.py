"""Tensor-parallel ranks across processes and GPUs, over the driver emulation (CPU twins of test_gpu_ranks.py).

The emulated machine has two GPUs with UUIDs. The deciding process (this one)
drives rank processes started under different visible-devices masks; each rank
is charged on the registry of the physical GPU it uses. The scenario is the
GPU tests' own (tests/rank_scenario.py, tests/landing_check.py); only memory access differs: ranks
write and read blocks through the emulated runtime or host views instead of
torch kernels, and with no kernels in flight the unmap fence is not exercised.
"""

from __future__ import annotations

import functools

import pytest

from landing_check import LANDING_MASKS_ONE_GPU, LANDING_MASKS_TWO_GPUS, check_landing
from rank_processes import REGISTRY_DIR_ENV, Machine
from rank_scenario import (
    PLACEMENTS,
    check_budgets_follow_every_step,
    check_refusal_leaves_nothing_taken,
    finish,
    start_ranks,
)

pytestmark = pytest.mark.emulation


@functools.cache
def emulated(backend: str, gpus: int) -> Machine:
    """One machine per configuration, so its physical GPU order is asked once."""
    return Machine.emulated(backend, gpus)


# Every placement through the CUDA face; GPUs in the other order through the HIP face too.
CASES = [("cuda", name) for name in PLACEMENTS] + [("hip", "two_gpus_reordered")]


@pytest.fixture
def registry_dir(tmp_path, monkeypatch):
    """A registry directory of the test's own, for this process and the ones it starts."""
    monkeypatch.setenv(REGISTRY_DIR_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture(params=CASES, ids=[f"{backend}-{name}" for backend, name in CASES])
def ranks(request, registry_dir):
    backend, name = request.param
    started = start_ranks(emulated(backend, 2), PLACEMENTS[name], registry_dir)
    yield started
    for rank in started:  # after a failure; finish() has closed them otherwise
        rank.worker.close()


def test_every_rank_is_charged_exactly_what_it_holds_at_every_step(ranks):
    check_budgets_follow_every_step(ranks)
    finish(ranks)


def test_a_rank_without_room_fails_the_allocation_for_all_with_nothing_taken(ranks):
    check_refusal_leaves_nothing_taken(ranks)
    finish(ranks)


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_processes_unset_and_0_on_one_gpu_land_in_its_one_registry(backend, registry_dir):
    snapshot = check_landing(emulated(backend, 1), LANDING_MASKS_ONE_GPU, registry_dir)
    assert len(list(registry_dir.iterdir())) == 1
    print(snapshot)


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_processes_under_four_masks_land_in_the_registries_of_the_two_physical_gpus(backend, registry_dir):
    snapshot = check_landing(emulated(backend, 2), LANDING_MASKS_TWO_GPUS, registry_dir)
    assert len(list(registry_dir.iterdir())) == 2
    print(snapshot)
