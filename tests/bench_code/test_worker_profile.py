"""bench/e2e/vllm_worker_profile.py's reading of perf's output: samples and waits per worker, per step."""

from __future__ import annotations

from vllm_worker_profile import samples_by, table, waits_by_reason

PIDS = {"on": 200, "off": 100}

# `perf script -F pid,tid,ip,sym,dso`, as perf prints it.
SAMPLES = """\
   100/100  ffffffff8226637e __schedule ([kernel.kallsyms])
   100/100      7f0cbf66f319 _PyFrame_Clear (/usr/lib/libpython3.11.so.1.0)
   100/100      7f0c00001000 [unknown] (/tmp/perf-100.map)
   200/200      7f0cbf66f319 _PyFrame_Clear (/usr/lib/libpython3.11.so.1.0)
   200/200      7f0cbf66f320 _PyFrame_Clear (/usr/lib/libpython3.11.so.1.0)
   200/200      7f0c00002000 [unknown] (/tmp/perf-200.map)
   200/207  ffffffff822563a7 clear_page_erms ([kernel.kallsyms])
   300/300  ffffffff822563a7 clear_page_erms ([kernel.kallsyms])
"""

# `perf script` of sched:sched_switch recorded with call graphs.
SWITCHES = """\
VLLM::Worker 200 [000] 10.000001: sched:sched_switch: prev_comm=VLLM::Worker prev_pid=200 prev_prio=120 \
prev_state=D ==> next_comm=swapper/0 next_pid=0 next_prio=120
\tffffffff82266208 __schedule+0x628 ([kernel.kallsyms])
\tffffffff82266b73 schedule+0x23 ([kernel.kallsyms])
\tffffffff82269a10 rwsem_down_write_slowpath+0x250 ([kernel.kallsyms])
\tffffffff82269c00 down_write_killable+0x40 ([kernel.kallsyms])
\tffffffff8130aa00 __do_sys_brk+0x60 ([kernel.kallsyms])
\t    7f0cbf000000 brk+0xb (/usr/lib/libc.so.6)

VLLM::Worker 200 [000] 10.000500: sched:sched_switch: prev_comm=VLLM::Worker prev_pid=200 prev_prio=120 \
prev_state=R ==> next_comm=gloo next_pid=201 next_prio=120
\tffffffff82266208 __schedule+0x628 ([kernel.kallsyms])
\tffffffff82260f7f irqentry_exit_to_user_mode+0x11f ([kernel.kallsyms])

VLLM::Worker 100 [001] 10.000900: sched:sched_switch: prev_comm=VLLM::Worker prev_pid=100 prev_prio=120 \
prev_state=S ==> next_comm=swapper/1 next_pid=0 next_prio=120
\tffffffff82266208 __schedule+0x628 ([kernel.kallsyms])
\tffffffff8140aa00 futex_do_wait+0x40 ([kernel.kallsyms])
\tffffffff8140ab00 __futex_wait+0x80 ([kernel.kallsyms])
\tffffffff8140ac00 futex_wait+0x70 ([kernel.kallsyms])

gloo 201 [000] 10.001000: sched:sched_switch: prev_comm=gloo prev_pid=201 prev_prio=120 \
prev_state=S ==> next_comm=VLLM::Worker next_pid=200 next_prio=120
\tffffffff82266208 __schedule+0x628 ([kernel.kallsyms])
\tffffffff8140aa00 futex_do_wait+0x40 ([kernel.kallsyms])
"""


def test_samples_are_counted_per_worker_with_other_threads_and_jit_code_apart():
    counts = samples_by(SAMPLES, PIDS)
    assert counts["off"]["sym"] == {"__schedule": 1, "_PyFrame_Clear": 1, "[unknown]": 1}
    assert counts["on"]["sym"] == {"_PyFrame_Clear": 2, "[unknown]": 1, "(other threads) clear_page_erms": 1}
    # Each process's JIT map file has its pid in its name: one name, so the two rows meet.
    assert counts["on"]["dso"]["perf-PID.map (JIT code)"] == counts["off"]["dso"]["perf-PID.map (JIT code)"] == 1
    assert counts["on"]["dso"]["libpython3.11.so.1.0"] == 2
    assert sum(counts["on"]["sym"].values()) == 4  # pid 300 is neither worker


def test_waits_are_the_main_threads_switches_out_in_d_or_s_by_where_it_waited():
    counts = waits_by_reason(SWITCHES, PIDS)
    assert counts["on"] == {"D: rwsem_down_write_slowpath < down_write_killable < __do_sys_brk": 1}  # R: preempted
    assert counts["off"] == {"S: futex_do_wait < __futex_wait < futex_wait": 1}


def test_table_puts_figures_per_step_and_the_main_thread_apart():
    counts = {"on": {"a": 30, "(other threads) b": 10}, "off": {"a": 10}}
    text = table(counts, {"on": 10, "off": 5}, 2.0, "ms per step", top=5, what="symbol")
    lines = text.splitlines()
    assert lines[0] == "| on − off (ms per step) | kvcached | vLLM's own | symbol |"
    assert lines[2] == "| +4.0000 | 8.0000 | 4.0000 | **all threads** |"  # 40 × 2 / 10 against 10 × 2 / 5
    assert lines[3] == "| +2.0000 | 6.0000 | 4.0000 | **the main thread** |"
    assert "| +2.0000 | 2.0000 | 0.0000 | `(other threads) b` |" in lines
