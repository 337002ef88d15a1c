"""SGLang's memory saver through kvcached, on the real SGLang 0.5.23 (its CPU build, where torch_memory_saver
does not exist): release_memory_occupation / resume_memory_occupation put the model's weights and the KV cache
to sleep and wake them in place, as RL post-training frameworks call them every step.

Two engines run side by side through ``sglang_harness.py`` on the tiny Llama: one rank with SGLang's CPU backup
of the weights (their contents kept while asleep), and tensor parallelism 2 without it (contents discarded, then
loaded again from the model's path, the RL flow) and without ``KVCACHED_NAME`` (the name kvcached derives). Each generates, releases, resumes, generates again, several
times; the registry is read after every release and resume (one row per rank: KV beside weights).
"""

from __future__ import annotations

import pytest

from kvcached.testing.sglang_env import require_sglang

require_sglang()
pytest.importorskip("kvcached.pool", reason="kvcached core not built")

from kvcached.testing.tiny_llama import prompt_ids  # noqa: E402
from sglang_runs import ENGINE, PAGE_ID_BYTES, engine_env, finish, probe, start  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.slow]

TWO_CORES = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1", "OMP_NUM_THREADS": "1"}
SAVER = {"enable_memory_saver": True}
PROMPTS = {"prompts": prompt_ids(4, 64, seed=5), "max_new_tokens": 8}
RANK0, RANKS = {"rank0-cpu"}, {"rank0-cpu", "rank1-cpu"}


def release(*tags: str) -> list:
    return ["release_memory_occupation", {"tags": list(tags)} if tags else {}]  # no tags: everything


def resume(*tags: str) -> list:
    return ["resume_memory_occupation", {"tags": list(tags)} if tags else {}]


def reload(model: str) -> list:
    return ["update_weights_from_disk", {"model_path": model}]


# One rank, weights kept in host memory while asleep: three cycles, by every tag at once and one tag at a time.
ONE_RANK_PHASES = [
    PROMPTS,
    {"engine_calls": [release()]},  # phase 1: everything asleep
    {**PROMPTS, "engine_calls": [resume()]},  # phase 2
    {"engine_calls": [release("kv_cache")]},  # phase 3: only the KV cache asleep
    {"engine_calls": [release("weights")]},  # phase 4: both
    {**PROMPTS, "engine_calls": [resume("weights"), resume("kv_cache")]},  # phase 5
    {"engine_calls": [release("weights", "kv_cache")]},  # phase 6
    {**PROMPTS, "engine_calls": [resume("kv_cache", "weights")]},  # phase 7
]


def tp2_phases(model: str) -> list[dict]:
    """TP=2 without the CPU backup: woken weights read zeros until loaded again from the model's path."""
    return [
        PROMPTS,
        {"engine_calls": [release()]},  # phase 1
        {**PROMPTS, "engine_calls": [resume()]},  # phase 2: not reloaded
        {"engine_calls": [release()]},  # phase 3
        {**PROMPTS, "engine_calls": [resume("weights"), reload(model), resume("kv_cache")]},  # phase 4
        {"engine_calls": [release()]},  # phase 5
        {**PROMPTS, "engine_calls": [resume(), reload(model)]},  # phase 6
    ]


@pytest.fixture(scope="module")
def saver_runs(sglang_workdir):
    workdir = sglang_workdir
    registry = workdir / "registry-saver"
    registry.mkdir()
    model = str(workdir / "model")
    started = {
        "one": start(
            workdir,
            "saver_one",
            {"engine": {**ENGINE, **SAVER, "enable_weights_cpu_backup": True}, "phases": ONE_RANK_PHASES},
            engine_env(True, registry, KVCACHED_NAME="saver-one"),
        ),
        "tp2": start(  # without KVCACHED_NAME: every rank finds the name kvcached derives on the first
            workdir,
            "saver_tp2",
            {
                "engine": {**ENGINE, **SAVER, "tp_size": 2},
                "phases": tp2_phases(model),
                "registry_name_prefix": "sglang:model:",
            },
            engine_env(True, registry, **TWO_CORES),
        ),
    }
    return {label: finish(workdir, f"saver_{label}", *run) for label, run in started.items()}


def rows(result: dict, label: str) -> dict[str, dict]:
    """Each rank's row (its KV cache and its weights together), by its local device."""
    found = probe(result, label)["rows"]
    by_rank = {row["local_device"]: row for row in found}
    assert len(by_rank) == len(found), found  # one row per rank
    return by_rank


def after_calls(result: dict, phase: int) -> dict[str, dict]:
    return rows(result, f"phase{phase}_calls")


def check_asleep(found: dict[str, dict], ranks: set[str]) -> None:
    assert found.keys() == ranks, found
    for rank, row in found.items():
        assert row["mapped_bytes"] == 0, (rank, row)  # every KV page, the padding page too
        assert row["weights_bytes"] == 0 and row["sleeping"] is True, (rank, row)


def check_awake(found: dict[str, dict], ranks: set[str], weights_bytes: dict[str, int]) -> None:
    assert found.keys() == ranks, found
    for rank, row in found.items():
        assert row["weights_bytes"] == weights_bytes[rank] > 0 and row["sleeping"] is False, (rank, row)
        assert row["mapped_bytes"] == PAGE_ID_BYTES, (rank, row)  # the padding page: the KV grows on demand


def test_one_rank_outputs_are_the_same_after_every_release_and_resume(saver_runs):
    one = saver_runs["one"]
    first = one["outputs"][0]
    assert len(first) == len(PROMPTS["prompts"]) and all(len(out) == PROMPTS["max_new_tokens"] for out in first)
    for phase in (2, 5, 7):
        assert one["outputs"][phase] == first, phase


def test_one_rank_gives_back_its_weights_and_its_kv_cache_and_takes_them_again(saver_runs):
    one = saver_runs["one"]
    init = rows(one, "after_init")
    assert init.keys() == RANK0 and init["rank0-cpu"]["weights_bytes"] > 0 and not init["rank0-cpu"]["sleeping"]
    weights_bytes = {"rank0-cpu": init["rank0-cpu"]["weights_bytes"]}
    for asleep in (1, 4, 6):
        check_asleep(after_calls(one, asleep), RANK0)
    only_kv = after_calls(one, 3)["rank0-cpu"]
    assert only_kv["mapped_bytes"] == 0 and only_kv["weights_bytes"] == weights_bytes["rank0-cpu"]
    for awake in (2, 5, 7):
        check_awake(after_calls(one, awake), RANK0, weights_bytes)
    stats = probe(one, "phase1_calls")["kvcached"]
    assert stats["mapped_pages"] == 0 and stats["asleep"] is True
    assert probe(one, "phase2_done")["kvcached"]["asleep"] is False


def test_tp2_every_rank_gives_back_its_weights_and_kv_cache(saver_runs):
    tp2 = saver_runs["tp2"]
    init = rows(tp2, "after_init")
    assert init.keys() == RANKS and len({row["pid"] for row in init.values()}) == 2  # each rank's own process
    # One name for the engine, derived from the first rank's process, on both ranks' rows.
    assert {row["name"] for row in init.values()} == {f"sglang:model:{init['rank0-cpu']['pid']}"}
    weights_bytes = {rank: row["weights_bytes"] for rank, row in init.items()}
    for asleep in (1, 3, 5):
        check_asleep(after_calls(tp2, asleep), RANKS)
    for awake in (2, 4, 6):
        check_awake(after_calls(tp2, awake), RANKS, weights_bytes)


def test_tp2_weights_woken_without_a_backup_are_loaded_again_from_the_model_path(saver_runs):
    tp2 = saver_runs["tp2"]
    first = tp2["outputs"][0]
    assert tp2["outputs"][2] != first  # woken without SGLang's CPU backup, the contents were discarded
    for phase in (4, 6):
        assert tp2["outputs"][phase] == first, phase  # loaded again: the same tokens
    reloads = [result for calls in tp2["call_results"] for result in calls if isinstance(result, list)]
    assert len(reloads) == 2 and all(result[0] is True for result in reloads), reloads
