"""bench/e2e/sglang_scheduler_profile.py's reading of py-spy's output: time per function and inside kvcached, per pass."""

from __future__ import annotations

from sglang_scheduler_profile import function, in_kvcached, inclusive, read_stacks, table

# `py-spy record --threads --format raw`, as py-spy writes it.
ON = """\
thread (10): MainThread;run (scheduler.py:10);forward (model.py:5);attn (attn.py:7) 30
thread (10): MainThread;run (scheduler.py:10);forward (model.py:6) 10
thread (10): MainThread;run (scheduler.py:12);alloc (kvcached/integration/sglang/v0_5_23/allocators.py:140);\
alloc (kvcached/integration/common/blocks.py:158) 4
thread (11): kvcached-idle-release;_watch (kvcached/integration/common/idle.py:166) 2
"""
OFF = """\
thread (20): MainThread;run (scheduler.py:10);forward (model.py:5);attn (attn.py:7) 20
thread (20): MainThread;run (scheduler.py:11);alloc (allocator.py:3) 2
"""


def test_stacks_keep_their_thread_and_frames():
    stacks = read_stacks(ON)
    assert stacks[0] == ("MainThread", ["run (scheduler.py:10)", "forward (model.py:5)", "attn (attn.py:7)"], 30)
    assert stacks[3][0] == "kvcached-idle-release"
    assert read_stacks("no count here\n\n") == []


def test_a_function_counts_once_per_stack_whatever_its_lines():
    assert function("run (scheduler.py:10)") == "run (scheduler.py)"
    counts = inclusive(read_stacks(ON), main_only=True)
    assert counts["run (scheduler.py)"] == 44  # on three stacks, at two lines
    assert counts["**all**"] == 44  # the idle-release thread is not the main thread
    assert inclusive(read_stacks(ON), main_only=False)["**all**"] == 46


def test_time_inside_kvcached_goes_to_the_outermost_kvcached_function():
    ours = in_kvcached(read_stacks(ON))
    assert ours == {
        "MainThread: alloc (kvcached/integration/sglang/v0_5_23/allocators.py)": 4,
        "kvcached-idle-release: _watch (kvcached/integration/common/idle.py)": 2,
    }
    assert in_kvcached(read_stacks(OFF)) == {}


def test_the_table_is_per_pass_with_the_total_first():
    counts = {"on": inclusive(read_stacks(ON), True), "off": inclusive(read_stacks(OFF), True)}
    text = table(counts, {"on": 2, "off": 1}, ms_per_sample=10.0, top=3).splitlines()
    assert text[2] == "| +0.0 | 220.0 | 220.0 | `**all**` |"  # 44 samples over 2 passes, 22 over 1
    assert text[3] == "| -50.0 | 150.0 | 200.0 | `attn (attn.py)` |"  # the largest difference next
    assert len(text) == 5
