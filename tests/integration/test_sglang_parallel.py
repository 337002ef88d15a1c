"""kvcached inside the real SGLang 0.5.23 with several ranks: tensor parallelism 2, pipeline parallelism 2.

Every rank runs its own scheduler; kvcached decides for all of them on the
first rank and the others replay its answers (``common/agreed_blocks.py``).
Engines run through ``sglang_harness.py`` on the tiny Llama (4 KV heads: 2 per
tensor rank; 2 layers: 1 per pipeline stage), both ranks on this host's CPU,
each on one torch thread (SGLang binds ranks to cores only where its CPU
kernels are built, AMX or arm64; elsewhere each rank would run a thread per
core, spinning on its sibling's). Each rank has its own
registry entry (``rank0-cpu``, ``rank1-cpu``) under its own process id.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcached.testing.registry_env import make_shared_budget  # noqa: E402
from kvcached.testing.sglang_env import require_sglang

require_sglang()
pytest.importorskip("kvcached.pool", reason="kvcached core not built")

from sglang_runs import (  # noqa: E402
    ENGINE,
    LOAD,
    PAGE_ID_BYTES,
    SHARED,
    engine_env,
    finish,
    kvctl,
    probe,
    start,
    wait_for_file,
)

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

TWO_CORES = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}
TP2 = {**ENGINE, "tp_size": 2}
PP2 = {**ENGINE, "pp_size": 2}
# A tensor rank holds half the KV heads: a page id costs what it costs on one rank (2 MiB x 2
# layers x K and V) and holds twice the tokens, 4096, so the load's 5824 slots take 2 pages beside
# the padding page. A pipeline stage holds one of the two layers: half the bytes, 2048 tokens.
STAGE_PAGE_ID_BYTES = PAGE_ID_BYTES // 2
RANKS = {"rank0-cpu", "rank1-cpu"}


@pytest.fixture(scope="module")
def parallel(sglang_workdir):
    """TP=2 without and with kvcached, side by side with PP=2 under kvcached; then
    ``kvctl set-limit`` caps rank 1 of the TP=2 engine alone (one page id: its padding page, 4095
    slots for a load of 5824) and its load runs again."""
    workdir = sglang_workdir
    registry = workdir / "registry-parallel"
    registry.mkdir()
    loaded, limited = workdir / "tp2.loaded", workdir / "tp2.limited"
    started = {
        "base_tp2": start(
            workdir, "base_tp2", {"engine": TP2, "phases": [SHARED, LOAD]}, engine_env(False, registry, **TWO_CORES)
        ),
        "kv_tp2": start(
            workdir,
            "kv_tp2",
            {"engine": TP2, "phases": [SHARED, {**LOAD, "signal": str(loaded)}, {**LOAD, "wait_for": str(limited)}]},
            engine_env(True, registry, KVCACHED_NAME="kv-tp2", **TWO_CORES),
        ),
        "kv_pp2": start(
            workdir,
            "kv_pp2",
            {"engine": PP2, "phases": [SHARED, LOAD]},
            engine_env(True, registry, KVCACHED_NAME="kv-pp2", **TWO_CORES),
        ),
    }
    try:
        wait_for_file(loaded, [proc for proc, _ in started.values()], "the TP=2 engine's first load")
        listing = json.loads(kvctl(registry, "list", "--json").stdout)
        (rank1,) = [e for e in listing["instances"] if e["name"] == "kv-tp2" and e["local_device"] == "rank1-cpu"]
        set_limit = kvctl(registry, "set-limit", f"pid:{rank1['pid']}", str(PAGE_ID_BYTES))
    finally:
        limited.write_text("done")
    runs = {label: finish(workdir, label, *run) for label, run in started.items()}
    runs["listing"], runs["set_limit"] = listing, set_limit
    return runs


def _rank_bytes(result: dict, label: str) -> dict[str, int]:
    return probe(result, label)["rank_bytes"]


def test_tp2_greedy_outputs_match_without_kvcached(parallel):
    kv, base = parallel["kv_tp2"], parallel["base_tp2"]
    assert kv["outputs"][:2] == base["outputs"]
    hits = kv["cached_tokens"][0]
    assert hits == base["cached_tokens"][0] and sum(hits) > 0  # the radix cache hits alike
    assert probe(kv, "after_init")["kvcached"]["ranks"][1]["rank"] == 1  # kvcached was active, on two ranks


def test_tp2_memory_grows_and_returns_on_every_rank(parallel):
    kv = parallel["kv_tp2"]
    for label in ("after_init", "phase0_done", "phase1_done"):
        assert _rank_bytes(kv, label) == dict.fromkeys(RANKS, PAGE_ID_BYTES), label  # idle: the padding page
    peaks = kv["peak_rank_bytes"][1]
    assert peaks.keys() == RANKS
    assert peaks == dict.fromkeys(RANKS, 3 * PAGE_ID_BYTES), peaks  # the load's pages, on both ranks


def test_tp2_ranks_populate_their_host_pages_on_touch(parallel, sglang_page1):
    # Each rank computes on its own core: populating in the background would run on the other's.
    assert probe(parallel["kv_tp2"], "after_init")["kvcached"]["host_populate"] == "on_touch"
    assert probe(sglang_page1["kv_p1"], "after_init")["kvcached"]["host_populate"] == "background"  # one rank


def test_kvctl_lists_every_rank_under_its_own_process(parallel):
    entries = [e for e in parallel["listing"]["instances"] if e["name"] == "kv-tp2"]
    assert {e["local_device"] for e in entries} == RANKS
    assert len({e["pid"] for e in entries}) == 2


def test_a_limit_on_one_rank_makes_requests_wait_on_every_rank_with_unchanged_outputs(parallel):
    kv, base = parallel["kv_tp2"], parallel["base_tp2"]
    assert parallel["set_limit"].returncode == 0, parallel["set_limit"].stderr
    assert kv["outputs"][2] == base["outputs"][1]  # the same load, under the limit: same tokens, no hang
    peaks = kv["peak_rank_bytes"][2]
    # Rank 1's limit binds rank 0 too: a page is taken on every rank or on none.
    assert peaks == dict.fromkeys(RANKS, PAGE_ID_BYTES), peaks
    stats = probe(kv, "phase2_done")["kvcached"]
    assert stats["short_secures"] > 0  # requests waited or were retracted for memory


def test_pp2_greedy_outputs_match_and_each_stage_holds_only_its_layers(parallel, sglang_page1):
    kv = parallel["kv_pp2"]
    assert kv["outputs"] == sglang_page1["base_p1"]["outputs"]  # a stage computes its layers as one rank does
    assert _rank_bytes(kv, "phase1_done") == dict.fromkeys(RANKS, STAGE_PAGE_ID_BYTES)
    peaks = kv["peak_rank_bytes"][1]
    assert peaks == dict.fromkeys(RANKS, 4 * STAGE_PAGE_ID_BYTES), peaks  # 3 pages of 2048 slots + padding


# --------------------------------------------------------------------------- #
# Two engines on one budget, one of them TP=2
# --------------------------------------------------------------------------- #

# Idle: 8 MiB a rank (the padding page). Peaks: 24 MiB a tensor rank, 32 MiB for the one-rank
# engine. The budget fits the TP=2 engine's peak (48 MiB) beside the other's idle page (8 MiB), not
# beside its peak (32 MiB).
SHARED_BUDGET_BYTES = 8 * PAGE_ID_BYTES


@pytest.fixture(scope="module")
def tp2_beside_one(sglang_workdir):
    workdir = sglang_workdir
    registry = make_shared_budget(workdir / "registry-tp-shared", SHARED_BUDGET_BYTES)
    flag = {name: workdir / f"tpshared.{name}" for name in ("b_ready", "a_done", "b_done", "release")}
    specs = {
        "tp_a": (
            TP2,
            [
                {"wait_for": str(flag["b_ready"])},
                {**LOAD, "settle_s": 0.4, "signal": str(flag["a_done"])},
                {"wait_for": str(flag["b_done"]), "settle_s": 0.0},
                {"wait_for": str(flag["release"])},
            ],
        ),
        "one_b": (
            ENGINE,
            [
                {"signal": str(flag["b_ready"])},
                {**LOAD, "wait_for": str(flag["a_done"]), "signal": str(flag["b_done"])},
                {"wait_for": str(flag["release"])},
            ],
        ),
    }
    # A's idle hold outlasts the test: A gives its memory back because B asks for it.
    holds = {"tp_a": "600", "one_b": "0"}
    started = {
        label: start(
            workdir,
            label,
            {"engine": engine, "phases": phases},
            engine_env(
                True, registry, KVCACHED_NAME=label.replace("_", "-"), KVCACHED_IDLE_RELEASE_S=holds[label], **TWO_CORES
            ),
        )
        for label, (engine, phases) in specs.items()
    }
    try:
        wait_for_file(Path(flag["b_done"]), [proc for proc, _ in started.values()], "the second load")
    finally:
        flag["release"].write_text("done")
    return {label: finish(workdir, label, *run) for label, run in started.items()}


def test_a_tp2_engine_and_another_take_turns_on_one_budget(tp2_beside_one, parallel, sglang_page1):
    a, b = tp2_beside_one["tp_a"], tp2_beside_one["one_b"]
    assert a["outputs"][1] == parallel["base_tp2"]["outputs"][1]
    assert b["outputs"][1] == sglang_page1["base_p1"]["outputs"][1]
    assert b["peak_mapped_bytes"][1] == 4 * PAGE_ID_BYTES  # B got the memory A had
    assert a["peak_rank_bytes"][1] == dict.fromkeys(RANKS, 3 * PAGE_ID_BYTES)
    # A gave its memory back, on both ranks, because B waited for it (its own hold is 600 s).
    stats = probe(a, "phase2_done")["kvcached"]
    assert stats["idle_early_releases"] >= 1
