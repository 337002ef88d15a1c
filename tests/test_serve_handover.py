"""Hand-overs told from registry samples: a refused model's wait, timed until its memory grows, credited to the giver."""

from __future__ import annotations

import dataclasses

from kvcached.serve.handover import Handover, HandoverTracker, WaitEnded, WaitStarted

MiB = 1 << 20


@dataclasses.dataclass
class Sample:
    mapped_bytes: int
    wanted_bytes: int = 0


def test_a_refused_model_that_gets_memory_is_a_handover_from_the_model_that_shrank():
    tracker = HandoverTracker()
    assert tracker.observe(0.0, {"a": Sample(40 * MiB), "b": Sample(8 * MiB), "c": Sample(4 * MiB)}) == []
    assert tracker.observe(1.0, {"a": Sample(40 * MiB), "b": Sample(8 * MiB, 4 * MiB), "c": Sample(4 * MiB)}) == [
        WaitStarted("b")
    ]
    assert tracker.observe(1.01, {"a": Sample(36 * MiB), "b": Sample(8 * MiB, 4 * MiB), "c": Sample(0)}) == []
    events = tracker.observe(1.02, {"a": Sample(20 * MiB), "b": Sample(24 * MiB, 4 * MiB), "c": Sample(0)})
    assert events[0] == Handover("b", "a", events[0].seconds) and abs(events[0].seconds - 0.02) < 1e-9
    assert events[1:] == [WaitEnded("b", events[0].seconds)]
    # The refusal just served still shows for up to a second: not a new wait.
    assert tracker.observe(1.5, {"a": Sample(20 * MiB), "b": Sample(24 * MiB, 4 * MiB), "c": Sample(0)}) == []
    # Still refused after the registry's window: refused again, a new wait.
    assert tracker.observe(2.1, {"a": Sample(20 * MiB), "b": Sample(24 * MiB, 4 * MiB), "c": Sample(0)}) == [
        WaitStarted("b")
    ]


def test_memory_from_the_free_budget_names_no_giver():
    tracker = HandoverTracker()
    tracker.observe(0.0, {"a": Sample(0, MiB), "b": Sample(MiB)})
    (handover, ended) = tracker.observe(0.5, {"a": Sample(4 * MiB), "b": Sample(MiB)})
    assert handover == Handover("a", "", 0.5) and ended == WaitEnded("a", 0.5)


def test_an_engine_refused_once_still_waits_after_its_refusal_fades():
    tracker = HandoverTracker(linger_s=5.0)
    tracker.observe(0.0, {"a": Sample(MiB, MiB), "b": Sample(40 * MiB)})
    assert tracker.observe(1.5, {"a": Sample(MiB), "b": Sample(40 * MiB)}) == []  # refusal faded, still waiting
    events = tracker.observe(2.0, {"a": Sample(9 * MiB), "b": Sample(32 * MiB)})
    assert events == [Handover("a", "b", 2.0), WaitEnded("a", 2.0)]


def test_a_wait_that_ends_without_memory_is_no_handover():
    tracker = HandoverTracker(linger_s=5.0)
    tracker.observe(0.0, {"a": Sample(MiB, MiB)})
    assert tracker.observe(0.5, {"a": Sample(MiB, MiB)}) == []
    assert tracker.observe(5.0, {"a": Sample(MiB)}) == []
    assert tracker.observe(5.6, {"a": Sample(MiB)}) == [WaitEnded("a", 0.5)]  # refused for the half second seen
    assert tracker.observe(7.0, {"a": Sample(8 * MiB)}) == []  # growth with no refusal: an ordinary grow
