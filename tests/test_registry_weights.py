"""Model weights in the device registry: weights_bytes and sleeping per entry, one budget for weights and KV."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvcached import _core
from kvcached.errors import RegistryUnusableError
from kvcached.registry import DeviceRegistry, MemoryPolicy
from registry_files import PAGE_BYTES, entry_offset, poke

DEVICE = "cpu"


@pytest.fixture(autouse=True)
def isolated_registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    return tmp_path


def entry(registry: DeviceRegistry, name: str) -> dict:
    (found,) = [e for e in registry.entries() if e["name"] == name]
    return found


def test_weights_are_charged_and_credited_on_their_entry_and_say_whether_they_sleep():
    registry = DeviceRegistry(DEVICE, 8 * PAGE_BYTES)
    budget = registry.register("model")
    weights = budget.weights_budget()
    assert (entry(registry, "model")["weights_bytes"], entry(registry, "model")["sleeping"]) == (0, False)
    space = _core.WeightSpace(_core.open_host_device(), 3 * PAGE_BYTES, weights)
    assert (budget.weights_bytes, budget.mapped_bytes, budget.sleeping) == (3 * PAGE_BYTES, 0, False)
    assert registry.weights_bytes == 3 * PAGE_BYTES and registry.mapped_bytes == 0
    assert registry.available_bytes == 5 * PAGE_BYTES
    space.sleep(2)
    assert (entry(registry, "model")["weights_bytes"], entry(registry, "model")["sleeping"]) == (0, True)
    assert space.try_wake()
    assert (entry(registry, "model")["weights_bytes"], entry(registry, "model")["sleeping"]) == (3 * PAGE_BYTES, False)
    space.close()
    assert (budget.weights_bytes, budget.sleeping) == (0, False)


def test_weights_and_kv_share_the_budget_both_ways():
    registry = DeviceRegistry(DEVICE, 8 * PAGE_BYTES)
    model, other = registry.register("model"), registry.register("other")
    space = _core.WeightSpace(_core.open_host_device(), 5 * PAGE_BYTES, model.weights_budget())
    assert not other.try_acquire(4 * PAGE_BYTES), "the weights hold 5 of 8 pages"
    assert other.try_acquire(3 * PAGE_BYTES)
    space.sleep(1)
    assert other.try_acquire(PAGE_BYTES), "asleep, the weights hold nothing"
    assert not space.try_wake(), "awake again they would not fit"
    assert space.sleep_level == 1
    assert entry(registry, "model")["wanted_bytes"] == 5 * PAGE_BYTES, "the refused wake is demand"
    assert other.pressure_bytes == 5 * PAGE_BYTES, "which the other instances see as pressure"
    other.release(4 * PAGE_BYTES)
    assert space.try_wake()
    space.close()


def test_a_refused_wake_sees_to_it_that_others_are_asked():
    registry = DeviceRegistry(DEVICE, 8 * PAGE_BYTES)
    high = registry.register("high", policy=MemoryPolicy(priority=5))
    low = registry.register("low", policy=MemoryPolicy(priority=0))
    assert low.try_acquire(8 * PAGE_BYTES)
    assert not high.weights_budget().try_charge(4 * PAGE_BYTES)
    assert low.pressure_bytes == 4 * PAGE_BYTES
    assert low.reclaim_target_bytes == 4 * PAGE_BYTES, "the lower priority is asked to make room"


def test_the_weights_leave_their_own_entrys_unclaimed_min_free():
    registry = DeviceRegistry(DEVICE, 8 * PAGE_BYTES)
    model = registry.register("model", policy=MemoryPolicy(min_bytes=3 * PAGE_BYTES))
    weights = model.weights_budget()
    assert not weights.try_charge(6 * PAGE_BYTES), "the KV min of 3 pages must stay claimable"
    assert weights.try_charge(5 * PAGE_BYTES)
    assert model.try_acquire(3 * PAGE_BYTES), "the min is still there for the KV cache"
    weights.credit(5 * PAGE_BYTES, False)


def test_a_dead_processs_weights_return_to_the_budget(isolated_registry_dir):
    registry = DeviceRegistry(DEVICE, 8 * PAGE_BYTES)
    code = (
        "from kvcached import _core\n"
        "from kvcached.registry import DeviceRegistry, MemoryPolicy\n"
        f"budget = DeviceRegistry('cpu', None).register('doomed')\n"
        f"space = _core.WeightSpace(_core.open_host_device(), {6 * PAGE_BYTES}, budget.weights_budget())\n"
        "import os; os._exit(0)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert entry(registry, "doomed")["weights_bytes"] == 6 * PAGE_BYTES
    assert registry.clean_stale() == 1
    assert registry.weights_bytes == 0 and registry.available_bytes == 8 * PAGE_BYTES


@pytest.mark.parametrize(
    "field, value, shown",
    [("weights_bytes", 2**60, "weights_bytes 1152921504606846976"), ("sleeping", 7, "sleeping 7")],
)
def test_a_file_whose_weights_fields_cannot_be_true_is_refused(field, value, shown):
    registry = DeviceRegistry(DEVICE, 8 * PAGE_BYTES)
    budget = registry.register("liar")
    poke(registry.path, entry_offset(budget.slot, field), value.to_bytes(8, "little"))
    with pytest.raises(RegistryUnusableError, match=shown):
        registry.entries()


def test_an_engines_weights_and_kv_join_one_entry_per_rank_and_the_last_handle_frees_it():
    import os

    registry = DeviceRegistry(DEVICE, 8 * PAGE_BYTES)
    weights_side = registry.register("engine", join=True)  # the rank loads its weights first
    space = _core.WeightSpace(_core.open_host_device(), 2 * PAGE_BYTES, weights_side.weights_budget())
    kv_side = registry.register(
        "engine", pid=os.getpid(), policy=MemoryPolicy(min_bytes=PAGE_BYTES, priority=3), join=True
    )
    assert kv_side.slot == weights_side.slot and kv_side.instance_id == weights_side.instance_id
    assert kv_side.try_acquire(PAGE_BYTES)
    (only,) = registry.entries()
    assert (only["weights_bytes"], only["mapped_bytes"], only["min_bytes"], only["priority"]) == (
        2 * PAGE_BYTES,
        PAGE_BYTES,
        PAGE_BYTES,
        3,
    ), "one row: the weights and the KV cache of the rank, under the engine's policy"
    space.close()
    weights_side.unregister()
    assert kv_side.registered, "the KV cache's handle keeps the entry"
    assert registry.entries()[0]["mapped_bytes"] == PAGE_BYTES
    kv_side.release(PAGE_BYTES)
    kv_side.unregister()
    assert registry.entries() == []
    other = registry.register("engine", join=False)
    assert registry.register("engine", join=True).slot == other.slot
    assert registry.register("other-name", join=True).slot != other.slot, "only the same name is joined"
    assert registry.register("engine", local_device="rank1-cpu", join=True).slot != other.slot, "nor another rank"


def test_a_sleeping_instance_claims_no_min_until_it_wakes():
    registry = DeviceRegistry(DEVICE, 8 * PAGE_BYTES)
    sleeper = registry.register("sleeper", policy=MemoryPolicy(min_bytes=4 * PAGE_BYTES))
    other = registry.register("other")
    weights = sleeper.weights_budget()
    assert weights.try_charge(2 * PAGE_BYTES)
    assert not other.try_acquire(3 * PAGE_BYTES), "awake, the sleeper's unclaimed min is set aside"
    weights.credit(2 * PAGE_BYTES, True)  # asleep
    assert other.try_acquire(8 * PAGE_BYTES), "asleep, it claims nothing: everything may be used"
    assert not weights.try_charge(2 * PAGE_BYTES), "its wake asks like anyone else"


def test_mins_that_fit_only_beside_sleeping_instances_are_accepted_and_a_wake_must_make_its_min_fit():
    """The mins of the instances awake fit the budget: a sleeping one's min is not counted when
    another registers or raises its min, and its wake takes its weights only where its min fits."""
    registry = DeviceRegistry(DEVICE, 8 * PAGE_BYTES)
    sleeper = registry.register("sleeper", policy=MemoryPolicy(min_bytes=4 * PAGE_BYTES))
    weights = sleeper.weights_budget()
    assert weights.try_charge(PAGE_BYTES)
    with pytest.raises(ValueError, match=r"registering 'late' with a min .* would sum to"):
        registry.register("late", policy=MemoryPolicy(min_bytes=5 * PAGE_BYTES))
    weights.credit(PAGE_BYTES, True)  # asleep: its min is claimed by nobody
    late = registry.register("late", policy=MemoryPolicy(min_bytes=5 * PAGE_BYTES))
    registry.set_policy("late", min_bytes=6 * PAGE_BYTES)
    assert entry(registry, "late")["min_bytes"] == 6 * PAGE_BYTES
    assert not weights.try_charge(PAGE_BYTES), "awake, its 4-page min would not fit beside the 6 pages of late's"
    assert entry(registry, "sleeper")["sleeping"]
    registry.set_policy("late", min_bytes=2 * PAGE_BYTES)
    assert weights.try_charge(PAGE_BYTES), "its weights and its min fit beside late's min now"
    late.unregister()
    sleeper.unregister()
