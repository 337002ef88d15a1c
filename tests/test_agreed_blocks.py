"""Ranks that each run a scheduler: one leader decides for all, followers replay its answers in their own processes."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from follower_process import FollowerProcess
from kvcached.errors import IntegrationError, OutOfMemoryError
from kvcached.integration.common.agreed_blocks import LeaderBlocks
from kvcached.integration.common.decision_channel import DecisionReceiver, DecisionSender
from kvcached.integration.common.engine_layout import engine_layout, stage_layout
from kvcached.integration.common.rank_devices import describe_rank
from kvcached.registry import MemoryPolicy, registry_for

KiB = 1 << 10
# 100 blocks of 4 KiB in 64 KiB pages (16 blocks a page); rank 1 is a pipeline stage holding one of the two layers.
LAYOUT = engine_layout(num_blocks=100, block_bytes=4 * KiB, num_layers=2, num_buffers=2, page_bytes=64 * KiB)
LAYOUTS = [LAYOUT, stage_layout(LAYOUT, 1)]
PAGE_ID_BYTES = 64 * KiB * 2 * 2


def _entries(name: str) -> dict[str, dict]:
    return {e["local_device"]: e for e in registry_for("cpu").entries() if e["name"] == name}


@pytest.fixture
def engine(request):
    """A leader (this process) and one follower (a process of its own), attached."""
    name = request.node.name[:60]
    follower = FollowerProcess(LAYOUTS, 1)
    ranks = [describe_rank("cpu", 0), follower.device]
    leader, setup = LeaderBlocks.open(LAYOUTS, ranks, name=name, policy=MemoryPolicy(), ack_timeout_s=0.5)
    follower.attach(setup)
    leader.followers_attached()
    yield leader, follower, name
    follower.close()
    leader.close()


def test_a_follower_gets_the_leaders_answers_and_maps_the_same_pages(engine):
    leader, follower, name = engine
    ids = leader.alloc(40)
    assert follower.call("alloc", 40) == ("ok", sorted(int(i) for i in ids))
    assert follower.call("own_mapped_pages") == ("ok", 3)  # with the null block's page
    assert leader.secure(10) and follower.call("secure", 10) == ("ok", True)
    available = leader.available()
    assert follower.call("available") == ("ok", available)
    assert leader.agree(lambda: "due") == "due"
    assert follower.call("agree", None) == ("ok", "due")  # the follower's own choice is never asked
    leader.free(ids)
    follower.call("free", ids)
    assert leader.logical_free() == 99 and follower.call("logical_free") == ("ok", 99)
    leader.end_step()
    follower.call("end_step")
    leader.trim()
    assert follower.call("trim")[0] == "ok"
    assert follower.call("own_mapped_pages") == ("ok", 1)  # the trim's unmaps came with its answer
    leader.stats()  # takes in the follower's acknowledgement: its charge goes back
    entries = _entries(name)
    assert entries["rank0-cpu"]["pid"] == os.getpid()
    assert entries["rank1-cpu"]["pid"] == follower.process.pid  # kvctl set-limit pid:N steers this rank alone
    assert entries["rank0-cpu"]["mapped_bytes"] == PAGE_ID_BYTES
    assert entries["rank1-cpu"]["mapped_bytes"] == PAGE_ID_BYTES // 2  # a stage: one layer of two


def test_a_limit_on_one_rank_refuses_every_rank_all_or_nothing(engine):
    leader, follower, name = engine
    registry_for("cpu").set_policy(follower.process.pid, max_bytes=2 * PAGE_ID_BYTES // 2)  # rank 1: two page ids
    assert not leader.secure(40)  # three pages: rank 1 cannot hold them, so no rank takes them
    assert follower.call("secure", 40) == ("ok", False)
    assert leader.secured == 31  # what one more page allows (15 free on the null block's page + 16)
    assert _entries(name)["rank0-cpu"]["mapped_bytes"] == 2 * PAGE_ID_BYTES
    ids = leader.alloc(16)
    assert follower.call("alloc", 16) == ("ok", sorted(int(i) for i in ids))
    with pytest.raises(OutOfMemoryError):
        leader.alloc(16)  # one block past what is secured needs a page rank 1 may not hold
    status, error = follower.call("alloc", 16)
    assert status == "error" and "OutOfMemoryError" in error  # refused on the follower too
    registry_for("cpu").set_policy(follower.process.pid, clear_max=True)


def test_a_dead_follower_is_lost_and_its_budget_returns(engine):
    leader, follower, name = engine
    ids = leader.alloc(40)
    follower.call("alloc", 40)
    follower.kill()
    deadline = time.monotonic() + 5
    while 1 not in leader.blocks.mirrors.lost and time.monotonic() < deadline:
        leader.free(leader.alloc(1))  # answers to a dead follower do not stop the leader
        time.sleep(0.1)
    assert "is gone" in leader.blocks.mirrors.lost[1]
    assert _entries(name)["rank1-cpu"]["mapped_bytes"] == 0
    leader.free(ids)
    leader.trim()
    assert _entries(name)["rank0-cpu"]["mapped_bytes"] == PAGE_ID_BYTES


def test_a_follower_that_asks_another_question_fails_naming_both(engine):
    leader, follower, name = engine
    leader.alloc(8)
    status, error = follower.call("secure", 8)
    assert status == "error" and "asked for 'secure' where the deciding rank answered 'alloc'" in error


def test_every_rank_sleeps_with_nothing_mapped_and_its_budget_back_when_the_leader_returns(engine):
    leader, follower, name = engine
    ids = leader.alloc(40)
    follower.call("alloc", 40)
    with pytest.raises(IntegrationError, match="40 blocks handed out"):
        leader.sleep()  # refused alike on every rank, before any message
    assert follower.call("sleep")[1].startswith("IntegrationError") and not leader.asleep
    leader.free(ids)
    follower.call("free", ids)
    assert leader.sleep() == 3 and leader.asleep
    assert _entries(name)["rank0-cpu"]["mapped_bytes"] == 0  # the null block's page too
    assert _entries(name)["rank1-cpu"]["mapped_bytes"] == 3 * PAGE_ID_BYTES // 2  # until rank 1 unmapped them
    assert follower.call("sleep") == ("ok", 3)
    assert follower.call("poll_acknowledgements") == ("ok", None)
    leader.poll_acknowledgements()
    assert _entries(name)["rank1-cpu"]["mapped_bytes"] == 0
    assert follower.call("own_mapped_pages") == ("ok", 0)
    with pytest.raises(OutOfMemoryError):
        leader.alloc(1)  # nothing is mapped until woken
    assert follower.call("alloc", 1)[1].startswith("OutOfMemoryError")
    assert leader.logical_free() == 99 and follower.call("logical_free") == ("ok", 99)
    leader.wake_up()
    assert follower.call("wake_up") == ("ok", None)
    assert follower.call("own_mapped_pages") == ("ok", 1)  # the null block's page, mapped again
    leader.stats()
    assert _entries(name)["rank1-cpu"]["mapped_bytes"] == PAGE_ID_BYTES // 2
    ids = leader.alloc(20)
    assert follower.call("alloc", 20) == ("ok", sorted(int(i) for i in ids))


def test_a_wake_up_refused_on_one_rank_leaves_every_rank_asleep(engine):
    leader, follower, name = engine
    leader.sleep()
    follower.call("sleep")
    leader.poll_acknowledgements()
    registry_for("cpu").set_policy(follower.process.pid, max_bytes=0)  # rank 1 may hold nothing
    with pytest.raises(OutOfMemoryError):
        leader.wake_up()
    status, error = follower.call("wake_up")
    assert status == "error" and error.startswith("OutOfMemoryError") and "could not wake" in error
    assert leader.asleep and _entries(name)["rank0-cpu"]["mapped_bytes"] == 0
    registry_for("cpu").set_policy(follower.process.pid, clear_max=True)
    leader.wake_up()
    assert follower.call("wake_up") == ("ok", None)


def test_a_follower_fails_clearly_when_the_leader_stops():
    sender = DecisionSender(1)
    receiver = DecisionReceiver(sender.paths[0], os.getpid())
    sender.followers_attached()
    sender.send(("alloc", np.arange(3), 0, None))
    assert receiver.receive()[0] == "alloc"
    sender.close()
    with pytest.raises(IntegrationError, match="stopped sending"):
        receiver.receive()
    receiver.close()


def test_the_leader_never_blocks_on_a_follower_that_does_not_read():
    sender = DecisionSender(1)
    receiver = DecisionReceiver(sender.paths[0], os.getpid())
    sender.followers_attached()
    big = np.arange(1 << 16)  # 512 KiB a message: the pipe fills after a few
    started = time.monotonic()
    for i in range(16):
        sender.send(("alloc", big + i, 0, None))
    assert time.monotonic() - started < 5  # the outbox took what the pipe could not
    for i in range(16):
        kind, value, _, _ = receiver.receive()
        assert kind == "alloc" and value[0] == i
    sender.close()
    receiver.close()


def test_a_follower_waits_for_a_late_answer_and_counts_the_wait():
    sender = DecisionSender(1)
    receiver = DecisionReceiver(sender.paths[0], os.getpid())
    sender.followers_attached()
    late = threading.Timer(0.05, sender.send, args=(("agree", True, 0, None),))
    late.start()
    assert receiver.receive()[:2] == ("agree", True)
    assert receiver.wait_s >= 0.04
    late.join()
    sender.close()
    receiver.close()


def test_a_follower_fails_clearly_when_the_leader_process_is_gone():
    sender = DecisionSender(1)
    receiver = DecisionReceiver(sender.paths[0], os.getpid(), is_alive=lambda pid: False)
    sender.followers_attached()
    with pytest.raises(IntegrationError, match="is gone; this rank cannot go on"):
        receiver.receive()  # nothing sent: after one poll interval the dead leader is noticed
    sender.close()
    receiver.close()
