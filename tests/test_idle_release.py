"""When an idle engine gives its memory back: after its hold, or at once when the device wants it."""

from __future__ import annotations

import threading
import time

import pytest

from kvcached.integration.common.idle import IdleRelease
from kvcached.registry import DeviceRegistry

PAGE_BYTES = 2 * 1024 * 1024


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeBudget:
    """What IdleRelease reads of a registry entry."""

    def __init__(self, pressure_bytes: int = 0, external_limit_bytes=None, mapped_bytes: int = 0) -> None:
        self.pressure_bytes = pressure_bytes
        self.external_limit_bytes = external_limit_bytes
        self.mapped_bytes = mapped_bytes


@pytest.fixture(autouse=True)
def isolated_registry_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))


def test_an_idle_engine_keeps_its_memory_for_the_hold_then_gives_it_back():
    clock = FakeClock()
    idle = IdleRelease(5.0, [FakeBudget()], clock=clock)
    assert not idle.due()  # the idle period starts here
    clock.now += 4.9
    assert not idle.due()
    clock.now += 0.1
    assert idle.due() and idle.num_early == 0


def test_work_starts_the_next_idle_period_from_zero():
    clock = FakeClock()
    idle = IdleRelease(5.0, [], clock=clock)
    assert not idle.due()
    clock.now += 4.0
    idle.busy()
    clock.now += 4.0
    assert not idle.due()  # a new idle period starts here, not 8 s into the old one
    clock.now += 4.9
    assert not idle.due()
    clock.now += 0.1
    assert idle.due()


def test_a_hold_of_zero_gives_memory_back_as_soon_as_idle():
    assert IdleRelease(0.0, [], clock=FakeClock()).due()


def test_memory_another_instance_was_refused_is_given_back_at_once():
    budget = FakeBudget()
    idle = IdleRelease(5.0, [FakeBudget(), budget], clock=FakeClock())
    assert not idle.due()
    budget.pressure_bytes = PAGE_BYTES
    assert idle.due() and idle.num_early == 1


def test_an_engine_holding_more_than_its_new_limit_gives_memory_back_at_once():
    budget = FakeBudget(external_limit_bytes=4 * PAGE_BYTES, mapped_bytes=4 * PAGE_BYTES)
    idle = IdleRelease(5.0, [budget], clock=FakeClock())
    assert not idle.due()  # at its limit, not over it
    budget.external_limit_bytes = 2 * PAGE_BYTES  # kvctl set-limit
    assert idle.due()


def test_pressure_is_read_from_the_device_registry():
    registry = DeviceRegistry("cpu", 2 * PAGE_BYTES)
    holder, needy = registry.register("holder"), registry.register("needy")
    idle = IdleRelease(60.0, [holder], clock=FakeClock())
    assert holder.try_acquire(2 * PAGE_BYTES)
    assert not idle.due()
    assert not needy.try_acquire(PAGE_BYTES)  # the device is full: the holder should give back
    assert idle.wanted() and idle.due()


def test_a_negative_hold_is_refused():
    with pytest.raises(ValueError, match="hold_s"):
        IdleRelease(-1.0, [])


def test_waking_needs_an_idle_period():
    idle = IdleRelease(5.0, [])
    with pytest.raises(RuntimeError, match="idle period"):
        idle.wake_when_due(lambda: None)


# ---- the watching thread (real clock) -------------------------------------------


def _watched(idle: IdleRelease) -> threading.Event:
    woken = threading.Event()
    assert not idle.due()
    idle.wake_when_due(woken.set)
    return woken


def test_the_engine_is_woken_once_its_hold_has_passed():
    idle = IdleRelease(0.2, [])
    start = time.monotonic()
    woken = _watched(idle)
    assert woken.wait(timeout=5.0)
    assert time.monotonic() - start >= 0.2
    assert idle.due()
    idle.close()


def test_the_engine_is_woken_as_soon_as_the_device_wants_its_memory():
    budget = FakeBudget()
    idle = IdleRelease(60.0, [budget])
    woken = _watched(idle)
    assert not woken.wait(timeout=0.1)
    budget.pressure_bytes = PAGE_BYTES
    start = time.monotonic()
    assert woken.wait(timeout=5.0)
    assert time.monotonic() - start < 1.0  # within a few polls, not the 60 s hold
    idle.close()


def test_an_engine_busy_again_is_not_woken():
    idle = IdleRelease(0.2, [])
    woken = _watched(idle)
    idle.busy()
    assert not woken.wait(timeout=0.5)
    idle.close()


def test_a_failing_wake_leaves_the_thread_serving_later_idle_periods():
    idle = IdleRelease(0.05, [])
    assert not idle.due()
    idle.wake_when_due(lambda: 1 / 0)
    time.sleep(0.3)
    idle.busy()
    woken = _watched(idle)
    assert woken.wait(timeout=5.0)
    idle.close()


def test_close_stops_the_thread_and_later_wakes_do_nothing():
    idle = IdleRelease(0.05, [])
    woken = _watched(idle)
    idle.close()
    assert not woken.wait(timeout=0.3)
    assert not any(thread.name == "kvcached-idle-release" and thread.is_alive() for thread in threading.enumerate())
    idle.wake_when_due(woken.set)
    assert not woken.wait(timeout=0.2)


@pytest.mark.parametrize("text", ["-1", "nan", "inf", "soon"])
def test_a_bad_idle_release_setting_is_refused_naming_it(monkeypatch, text):
    from kvcached import config
    from kvcached.errors import ConfigurationError

    monkeypatch.setenv("KVCACHED_IDLE_RELEASE_S", text)
    with pytest.raises(ConfigurationError, match="KVCACHED_IDLE_RELEASE_S"):
        config.get("idle_release_s")


def test_an_idle_release_of_zero_is_accepted(monkeypatch):
    from kvcached import config

    monkeypatch.setenv("KVCACHED_IDLE_RELEASE_S", "0")
    assert config.get("idle_release_s") == 0.0


def _idle_spell(idle: IdleRelease, clock: FakeClock, seconds: float) -> bool:
    """An idle spell of ``seconds`` (due() asked at its start and end), then work; whether it released."""
    idle.due()
    clock.now += seconds
    released = idle.due()
    idle.busy()
    return released


def _learning(clock: FakeClock, budgets=()) -> IdleRelease:
    """A 5 s hold that may grow to 30 s, on an engine that has worked."""
    idle = IdleRelease(5.0, list(budgets), max_hold_s=30.0, clock=clock)
    idle.busy()
    return idle


def test_a_hold_that_ran_out_just_before_work_came_back_grows_to_cover_such_spells():
    clock = FakeClock()
    idle = _learning(clock)
    assert _idle_spell(idle, clock, 10.0)  # released after 5 s, work back 5 s later
    assert idle.hold_s == pytest.approx(15.0)
    assert not _idle_spell(idle, clock, 10.0)  # the next such spell keeps the memory
    assert idle.hold_s == pytest.approx(15.0)  # and a kept spell changes nothing
    assert not idle.due()
    clock.now += 14.9
    assert not idle.due()
    clock.now += 0.1
    assert idle.due()


def test_the_hold_grows_at_most_to_its_maximum_and_a_longer_spell_sets_it_back():
    clock = FakeClock()
    idle = _learning(clock)
    assert _idle_spell(idle, clock, 10.0) and _idle_spell(idle, clock, 29.0)
    assert idle.hold_s == pytest.approx(30.0)  # 1.5 x 29 s, capped at 30 s
    assert _idle_spell(idle, clock, 31.0)  # longer than the longest hold: a genuinely idle engine
    assert idle.hold_s == pytest.approx(5.0)


def test_an_early_release_for_the_device_or_work_within_the_hold_leaves_the_hold_alone():
    clock = FakeClock()
    budget = FakeBudget()
    idle = _learning(clock, [budget])
    assert not _idle_spell(idle, clock, 4.0)
    assert not idle.due()
    clock.now += 1.0
    budget.pressure_bytes = PAGE_BYTES
    assert idle.due() and idle.num_early == 1
    clock.now += 1.0
    idle.busy()
    assert idle.hold_s == 5.0


def test_the_spell_before_the_first_work_teaches_nothing():
    clock = FakeClock()
    idle = IdleRelease(5.0, [], max_hold_s=30.0, clock=clock)
    assert _idle_spell(idle, clock, 10.0)  # an engine waiting for its first request
    assert idle.hold_s == 5.0
    assert _idle_spell(idle, clock, 10.0)
    assert idle.hold_s == pytest.approx(15.0)


def test_without_a_maximum_above_it_or_with_a_hold_of_zero_the_hold_stays_fixed():
    clock = FakeClock()
    fixed = IdleRelease(5.0, [], clock=clock)
    fixed.busy()
    assert _idle_spell(fixed, clock, 10.0) and fixed.hold_s == 5.0
    at_once = IdleRelease(0.0, [], max_hold_s=30.0, clock=clock)
    at_once.busy()
    assert _idle_spell(at_once, clock, 1.0) and at_once.hold_s == 0.0


def test_a_negative_maximum_hold_is_refused():
    with pytest.raises(ValueError, match="max_hold_s"):
        IdleRelease(5.0, [], max_hold_s=-1.0)


def test_the_maximum_hold_setting_is_read_and_checked(monkeypatch):
    from kvcached import config
    from kvcached.errors import ConfigurationError

    monkeypatch.setenv("KVCACHED_IDLE_RELEASE_MAX_S", "12")
    assert config.get("idle_release_max_s") == 12.0
    monkeypatch.setenv("KVCACHED_IDLE_RELEASE_MAX_S", "soon")
    with pytest.raises(ConfigurationError, match="KVCACHED_IDLE_RELEASE_MAX_S"):
        config.get("idle_release_max_s")
