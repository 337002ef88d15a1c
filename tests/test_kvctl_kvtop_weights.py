"""kvctl and kvtop show model weights beside the KV caches: WEIGHTS, asleep instances, and the
weights counted in what a device's instances hold."""

from __future__ import annotations

import io
import multiprocessing
import os
import re
import signal

import pytest

from kvcached.cli import kvtop
from kvcached.cli.widgets import FREE_CHAR, FREE_MAPPED_CHAR, USED_CHAR, WEIGHTS_CHAR, UsageBar
from kvcached.registry import DeviceRegistry, MemoryPolicy
from test_kvctl_kvtop import BUDGET_BYTES, COMMAND_TIMEOUT_S, DEVICE, PAGE_BYTES, kvctl_json, run

BAR_CHARS = WEIGHTS_CHAR + USED_CHAR + FREE_MAPPED_CHAR + FREE_CHAR


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    return {**os.environ, "COLUMNS": "200"}


@pytest.fixture
def registry(env):
    return DeviceRegistry(DEVICE, BUDGET_BYTES)


@pytest.fixture
def engines(registry):
    """Three instances: one with awake weights beside its KV cache (and a limit), one whose
    weights sleep, one with a KV cache alone. Kept alive by the test holding them."""
    awake = registry.register("awake-llama", policy=MemoryPolicy(max_bytes=16 * PAGE_BYTES))
    assert awake.try_acquire(4 * PAGE_BYTES)
    awake.report_usage(PAGE_BYTES, 4 * PAGE_BYTES)
    assert awake.weights_budget().try_charge(10 * PAGE_BYTES)
    asleep = registry.register("asleep-qwen")
    weights = asleep.weights_budget()
    assert weights.try_charge(6 * PAGE_BYTES)
    weights.credit(6 * PAGE_BYTES, True)
    plain = registry.register("kv-only")
    assert plain.try_acquire(2 * PAGE_BYTES)
    return awake, asleep, plain


def table_rows(text: str) -> dict[str, dict[str, str]]:
    """kvctl's instance table by name, each row as {column: cell}, cut at the header's column starts."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("NAME"))
    columns = list(re.finditer(r"\S+", lines[start]))
    names, starts = [column.group() for column in columns], [column.start() for column in columns]
    rows = {}
    for line in lines[start + 1 :]:
        cells = [line[a:b].strip() for a, b in zip(starts, starts[1:] + [len(line)])]
        rows[cells[0]] = dict(zip(names, cells))
    return rows


# ---- kvctl -------------------------------------------------------------------------------------


def test_kvctl_list_json_has_each_instances_weights_and_whether_they_sleep(env, registry, engines):
    listing = kvctl_json(env, "list")
    assert (listing["mapped_bytes"], listing["weights_bytes"]) == (6 * PAGE_BYTES, 10 * PAGE_BYTES)
    assert listing["available_bytes"] == BUDGET_BYTES - 16 * PAGE_BYTES, "the budget less KV and weights"
    by_name = {entry["name"]: entry for entry in listing["instances"]}
    assert {name: (e["weights_bytes"], e["sleeping"], e["mapped_bytes"]) for name, e in by_name.items()} == {
        "awake-llama": (10 * PAGE_BYTES, False, 4 * PAGE_BYTES),
        "asleep-qwen": (0, True, 0),
        "kv-only": (0, False, 2 * PAGE_BYTES),
    }
    (device,) = kvctl_json(env, "list", "--all")["devices"]
    assert (device["mapped_bytes"], device["weights_bytes"]) == (6 * PAGE_BYTES, 10 * PAGE_BYTES)
    assert device["instances"] == listing["instances"]


def test_kvctl_list_shows_weights_and_asleep_and_counts_weights_as_held(env, registry, engines):
    human = run(env, "kvctl", "list").stdout
    summary = human.splitlines()[0]
    assert summary.startswith(
        "cpu: budget 128.0 MiB, held 32.0 MiB (KV 12.0 MiB, weights 20.0 MiB), available 96.0 MiB"
    ), summary
    rows = table_rows(human)
    assert {name: (row["STATE"], row["MAPPED"], row["WEIGHTS"]) for name, row in rows.items()} == {
        "awake-llama": ("alive", "8.0 MiB", "20.0 MiB"),
        "asleep-qwen": ("asleep", "0 B", "-"),
        "kv-only": ("alive", "4.0 MiB", "-"),
    }
    assert list(rows["awake-llama"]).index("WEIGHTS") == list(rows["awake-llama"]).index("MAPPED") + 1


def test_kvctl_list_shows_a_real_model_asleep_and_awake(env, registry):
    torch = pytest.importorskip("torch")
    import kvcached

    engine = registry.register("tiny-model")
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    with kvcached.ModelWeights(model, device="cpu", budget=engine) as weights:
        (awake,) = kvctl_json(env, "list")["instances"]
        assert (awake["weights_bytes"], awake["sleeping"]) == (weights.nbytes, False) and weights.nbytes > 0
        assert table_rows(run(env, "kvctl", "list").stdout)["tiny-model"]["STATE"] == "alive"
        weights.sleep(level=1)
        (asleep,) = kvctl_json(env, "list")["instances"]
        assert (asleep["weights_bytes"], asleep["sleeping"]) == (0, True)
        row = table_rows(run(env, "kvctl", "list").stdout)["tiny-model"]
        assert (row["STATE"], row["WEIGHTS"]) == ("asleep", "-")
        weights.wake_up()
        assert kvctl_json(env, "list")["weights_bytes"] == weights.nbytes


def test_kvctl_set_budget_counts_weights_when_it_says_the_device_is_over(env, registry, engines):
    # 12 MiB of KV and 20 MiB of weights are held: 16 MiB is above the KV alone, below both.
    result = kvctl_json(env, "set-budget", "16MiB")
    assert (result["mapped_bytes"], result["weights_bytes"]) == (6 * PAGE_BYTES, 10 * PAGE_BYTES)
    assert "over budget" in run(env, "kvctl", "set-budget", "16MiB").stdout
    assert "over budget" not in run(env, "kvctl", "set-budget", "64MiB").stdout


def sleep_and_die(name: str) -> None:
    """A child process whose weights sleep when it is killed."""
    weights = DeviceRegistry(DEVICE).register(name).weights_budget()
    assert weights.try_charge(PAGE_BYTES)
    weights.credit(PAGE_BYTES, True)
    os.kill(os.getpid(), signal.SIGKILL)  # die without unregistering


def test_an_instance_that_died_asleep_reads_dead(env, registry):
    child = multiprocessing.get_context("spawn").Process(target=sleep_and_die, args=("crashed",))
    child.start()
    child.join(COMMAND_TIMEOUT_S)
    assert child.exitcode == -signal.SIGKILL
    (entry,) = kvctl_json(env, "list")["instances"]
    assert (entry["alive"], entry["sleeping"]) == (False, True)
    assert table_rows(run(env, "kvctl", "list").stdout)["crashed"]["STATE"] == "dead"
    (row,) = [line for line in run(env, "kvtop", "--once").stdout.splitlines() if line.startswith("crashed")]
    assert " dead " in row and "asleep" not in row, row


# ---- kvtop -------------------------------------------------------------------------------------


def test_kvtop_shows_weights_asleep_and_the_held_memory(env, registry, engines):
    frame = run(env, "kvtop", "--once").stdout
    assert "budget 128.0 MiB  held 32.0 MiB (25%)  available 96.0 MiB" in frame, frame
    assert "weights 20.0 MiB  KV 12.0 MiB" in frame, frame
    lines = frame.splitlines()
    header = next(line for line in lines if line.startswith("NAME"))
    assert header.split()[:6] == ["NAME", "PID", "AS", "USED", "MAPPED", "WEIGHTS"], header
    row = {line.split()[0]: line for line in lines if line.startswith(("awake-", "asleep-", "kv-only"))}
    assert row["awake-llama"].split()[4:7] == ["8.0M", "20M", "32M"], row["awake-llama"]
    assert " asleep " in row["asleep-qwen"] and " ok " in row["awake-llama"] and " ok " in row["kv-only"]
    assert WEIGHTS_CHAR in row["awake-llama"] and WEIGHTS_CHAR not in row["kv-only"]
    assert f"{WEIGHTS_CHAR} weights" in lines[-1], "the legend names the weights' part of the bars"


def test_kvtop_shows_no_weights_column_where_no_instance_has_weights(env, registry):
    engine = registry.register("kv-only")
    assert engine.try_acquire(PAGE_BYTES)
    frame = run(env, "kvtop", "--once").stdout
    assert "WEIGHTS" not in frame and "held 2.0 MiB" in frame and engine.registered


def test_kvtop_says_an_asleep_instance_waits_for_a_refused_wake(env, registry):
    engine = registry.register("woken-too-soon")
    weights = engine.weights_budget()
    assert weights.try_charge(PAGE_BYTES)
    weights.credit(PAGE_BYTES, True)
    hog = registry.register("hog")
    assert hog.try_acquire(BUDGET_BYTES)
    assert not weights.try_charge(PAGE_BYTES), "no room to wake"
    frame = run(env, "kvtop", "--once").stdout
    (row,) = [line for line in frame.splitlines() if line.startswith("woken-too-soon")]
    assert "asleep waits 2.0M" in row, row


def render(registry: DeviceRegistry, width: int) -> list[str]:
    console = kvtop.Console(file=io.StringIO(), width=width, color_system=None)
    console.print(kvtop.device_view(registry, width))
    return console.file.getvalue().splitlines()


@pytest.mark.parametrize("width", [80, 100, 120, 160])
def test_kvtop_bars_fit_the_terminal_and_keep_their_scale(env, registry, engines, width):
    """Each bar is drawn whole at the width it gets, never cut at the terminal's edge: of 26 pages
    (10 of weights and the 16-page limit of its KV cache), 10 weights, 1 KV used, 3 mapped but free."""
    lines = render(registry, width)
    assert max(len(line) for line in lines) <= width, "\n".join(lines)
    (row,) = [line for line in lines if line.startswith("awake-llama")]
    bar = row[len(row.rstrip(BAR_CHARS)) :]
    cells = len(bar)
    assert 10 <= cells <= 40, row
    expected = UsageBar(PAGE_BYTES, 3 * PAGE_BYTES, 26 * PAGE_BYTES, 10 * PAGE_BYTES).text(cells).plain
    assert bar == expected, (bar, expected)
    assert bar.count(WEIGHTS_CHAR) == round(cells * 10 / 26) and bar.endswith(FREE_CHAR)


def test_kvtop_drops_columns_in_order_on_a_narrow_terminal():
    widths = {"NAME": 24, "PID": 7, "AS": 6, "USED": 5, "MAPPED": 6, "WEIGHTS": 7, "MIN": 5, "LIMIT": 5}
    widths.update({"PRIO": 4, "STATUS": 6, "USAGE": 10})
    seen = []
    for total_width in range(200, 40, -1):
        shown, _spare = kvtop._columns_that_fit(widths, total_width)
        dropped = [column for column in widths if column not in shown]
        if dropped not in seen:
            seen.append(dropped)
    assert seen == [
        [],
        ["USAGE"],
        ["AS", "USAGE"],
        ["AS", "MIN", "USAGE"],
        ["AS", "MIN", "PRIO", "USAGE"],
        ["AS", "WEIGHTS", "MIN", "PRIO", "USAGE"],
    ]


@pytest.mark.parametrize("pid_width", [3, 5, 7])
def test_kvtop_lets_columns_give_way_before_a_name_is_cut(pid_width):
    """Whatever width the process ids take, a 28-cell name stays whole at 80 columns while some
    optional column can still give way; a name too long for any layout is cut, never below 24."""
    widths = {"PID": pid_width, "AS": 6, "USED": 4, "MAPPED": 6, "WEIGHTS": 7, "MIN": 4, "LIMIT": 5}
    widths.update({"PRIO": 4, "STATUS": 6})
    shown, name_width, _bar = kvtop._layout(widths, 28, 80)
    assert name_width == 28 and "PID" in shown and "STATUS" in shown, shown
    used = sum(widths.get(column, name_width) for column in shown if column != "USAGE")
    assert used + kvtop.CELL_PADDING * (len(shown) - 1) <= 80, shown
    shown, name_width, _bar = kvtop._layout(widths, 60, 60)
    assert name_width == kvtop.NAME_MIN_WIDTH and "USAGE" not in shown, shown


def test_kvtop_keeps_names_whole_with_weights_at_80_columns(env, registry, engines):
    long_name = "engine-llama-3.1-8b-instruct"  # 28 characters
    busy = registry.register(long_name, policy=MemoryPolicy(min_bytes=PAGE_BYTES, priority=2))
    assert busy.weights_budget().try_charge(PAGE_BYTES)
    frame = run({**env, "COLUMNS": "80"}, "kvtop", "--once").stdout
    assert long_name in frame and "WEIGHTS" in frame and "asleep" in frame, frame
    assert max(len(line) for line in frame.splitlines()) <= 80, frame


# ---- the bar -----------------------------------------------------------------------------------


@pytest.mark.parametrize("width", [10, 17, 40])
def test_usage_bar_stacks_weights_used_and_free_mapped_and_fills_its_width(width):
    bar = UsageBar(used_bytes=3, free_mapped_bytes=2, scale_bytes=20, weights_bytes=5).text(width).plain
    assert len(bar) == width
    assert bar == "".join(sorted(bar, key=BAR_CHARS.index)), "weights, used, mapped but free, then the rest"
    assert [bar.count(char) for char in BAR_CHARS] == [
        round(width * 5 / 20),
        round(width * 8 / 20) - round(width * 5 / 20),
        round(width * 10 / 20) - round(width * 8 / 20),
        width - round(width * 10 / 20),
    ]
    over = UsageBar(used_bytes=4, free_mapped_bytes=0, scale_bytes=5, weights_bytes=6).text(width).plain
    assert FREE_CHAR not in over and over.count(WEIGHTS_CHAR) == round(width * 6 / 10), "the scale grows to fit"
