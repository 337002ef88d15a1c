"""On real GPUs: tensor-parallel ranks in their own processes, one registry per physical GPU.

One block manager (this process, which never opens a device) drives two
rank-like KV spaces in two other processes, each charged on its own entry in
the registry of the GPU it uses. Torch kernels write blocks through the spaces'
DLPack views and are still running when unmaps arrive: the spaces fence them,
so no kernel faults (the rank synchronises after every batch). Every entry and
every registry reads exactly what the ranks hold after every step, and zero at
the end. With one GPU both ranks share it; with two, the same scenario runs on
cuda:0 and cuda:1 (and on the GPUs seen in the other order), and two demos run
at once, one per GPU. The scenario is tests/rank_scenario.py and tests/landing_check.py,
shared with the CPU twins in test_emulated_ranks.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import kvcached
from landing_check import LANDING_MASKS_ONE_GPU, LANDING_MASKS_TWO_GPUS, check_landing
from rank_processes import REGISTRY_DIR_ENV, Machine
from rank_scenario import (
    PLACEMENTS,
    check_budgets_follow_every_step,
    check_refusal_leaves_nothing_taken,
    finish,
    gpus_needed,
    start_ranks,
)

pytestmark = pytest.mark.gpu

DEMO_TIMEOUT_S = 240
DEMO_DURATION_S = "4"
MIB = 1 << 20


@pytest.fixture(scope="module")
def machine() -> Machine:
    return Machine.current(kvcached.default_device().split(":")[0])


def require_gpus(machine: Machine, count: int) -> None:
    visible = len(machine.physical_identities())
    if visible < count:
        pytest.skip(f"needs {count} GPUs; {visible} visible to a process without {machine.mask_variable}")


@pytest.fixture
def registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(REGISTRY_DIR_ENV, str(tmp_path))
    return tmp_path


@pytest.fixture(params=list(PLACEMENTS))
def ranks(request, machine, registry_dir):
    placements = PLACEMENTS[request.param]
    require_gpus(machine, gpus_needed(placements))
    started = start_ranks(machine, placements, registry_dir)
    yield started
    for rank in started:  # after a failure; finish() has closed them otherwise
        rank.worker.close()


def test_every_rank_is_charged_exactly_what_it_holds_while_kernels_write_and_unmaps_arrive(ranks):
    print("\n".join(check_budgets_follow_every_step(ranks)))
    finish(ranks)


def test_a_rank_without_room_fails_the_allocation_for_all_with_nothing_taken(ranks):
    print("\n".join(check_refusal_leaves_nothing_taken(ranks)))
    finish(ranks)


def test_processes_unset_and_0_land_in_one_registry_that_kvctl_shows_by_identity(machine, registry_dir):
    print(check_landing(machine, LANDING_MASKS_ONE_GPU, registry_dir))


def test_processes_under_four_masks_land_in_the_registries_of_the_two_physical_gpus(machine, registry_dir):
    require_gpus(machine, 2)
    print(check_landing(machine, LANDING_MASKS_TWO_GPUS, registry_dir))
    assert len(list(registry_dir.iterdir())) == 2


# ---- the demo on the second GPU, and one demo per GPU at once ------------------------------------


def start_demo(machine: Machine, device: str, budget_mib: int, summary_path) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "kvcached",
        "demo",
        "--device",
        device,
        "--budget",
        f"{budget_mib}MiB",
        "--duration",
        DEMO_DURATION_S,
        "--no-live",
        "--plot",
        "",
        "--json",
        str(summary_path),
    ]
    return subprocess.Popen(command, env=machine.base_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finished_demo(demo: subprocess.Popen, summary_path) -> dict:
    output, _ = demo.communicate(timeout=DEMO_TIMEOUT_S)
    print(output)
    assert demo.returncode == 0, output
    summary = json.loads(summary_path.read_text())
    assert summary["ok"], output
    for run in summary["runs"].values():
        assert run["peak_device_mapped_bytes"] <= summary["config"]["budget_bytes"]
        assert (run["registry_mapped_after_bytes"], run["registry_entries_after"]) == (0, 0)
    return summary


def test_the_demo_runs_on_the_second_gpu(machine, tmp_path):
    require_gpus(machine, 2)
    device = f"{machine.backend}:1"
    summary = finished_demo(start_demo(machine, device, 240, tmp_path / "demo.json"), tmp_path / "demo.json")
    assert summary["config"]["device"] == device


def test_two_demos_at_once_on_two_gpus_keep_separate_budgets(machine, tmp_path):
    """Each demo stays within its own budget; the larger one's peak is beyond the smaller's
    budget, which it could not be if they shared one."""
    require_gpus(machine, 2)
    small, large = (f"{machine.backend}:0", 240), (f"{machine.backend}:1", 480)
    demos = [
        (start_demo(machine, device, mib, tmp_path / f"{mib}.json"), tmp_path / f"{mib}.json")
        for device, mib in (small, large)
    ]
    summaries = [finished_demo(demo, path) for demo, path in demos]
    assert [s["config"]["device"] for s in summaries] == [small[0], large[0]]
    peak_of_large = summaries[1]["runs"]["elastic"]["peak_device_mapped_bytes"]
    assert peak_of_large > small[1] * MIB, f"the {large[0]} demo peaked at {peak_of_large >> 20} MiB"
