"""The SGLang plugin and its pieces inside SGLang 0.5.23, without an engine.

Gating, version check and idempotence of the entry point; SGLang's own KV pool,
allocator and prefill-budget classes as kvcached subclasses, driven the way
SGLang's scheduler drives them, on the host backend.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys

import pytest

from kvcached.testing.sglang_env import require_sglang

sglang = require_sglang()
import torch  # noqa: E402  (SGLang needs it)

from kvcached.integration import sglang as plugin  # noqa: E402
from kvcached.integration.common.settings import Settings  # noqa: E402
from kvcached.registry import MemoryPolicy  # noqa: E402

pytestmark = pytest.mark.sglang
SUPPORTED = plugin.POLICY.release_of(sglang.__version__) in plugin.POLICY.releases
needs_supported = pytest.mark.skipif(not SUPPORTED, reason=f"SGLang {sglang.__version__} is not supported")
MiB = 1 << 20


@pytest.fixture
def no_flags(monkeypatch):
    for name in ("KVCACHED_ENABLE", "ENABLE_KVCACHED"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_register_is_a_no_op_when_disabled(no_flags):
    before = dict(plugin._installed)
    plugin.register()
    assert plugin._installed == before


@pytest.mark.parametrize("version", ["0.5.15", "0.5.22", "0.5.24", "0.6.0", "dev"])
def test_other_sglang_versions_are_refused_by_name(version):
    with pytest.raises(plugin.UnsupportedSGLangVersion, match="supported: 0.5.23"):
        plugin.module_for(version)


def test_supported_versions_resolve_to_one_module():
    assert plugin.module_for("0.5.23").__name__.endswith("v0_5_23")
    assert plugin.module_for("0.5.23.post1").__name__.endswith("v0_5_23")


def test_register_logs_and_survives_an_unsupported_sglang(no_flags, caplog):
    no_flags.setenv("KVCACHED_ENABLE", "1")
    no_flags.setattr(sglang, "__version__", "0.5.99")
    no_flags.setattr(plugin._plugin, "installed", {})
    with caplog.at_level(logging.ERROR, logger="kvcached.integration.sglang"):
        plugin.register()  # must not raise: SGLang then runs without kvcached
    assert plugin._plugin.installed == {}
    assert "kvcached is NOT active" in caplog.text and "0.5.99" in caplog.text and "0.5.23" in caplog.text


def test_entry_point_is_in_sglangs_plugin_group():
    points = importlib.metadata.entry_points(group="sglang.srt.plugins")
    assert any(p.name == "kvcached" and p.value == "kvcached.integration.sglang:register" for p in points)


@needs_supported
def test_every_hooked_sglang_name_is_in_place_and_declared():
    module = plugin.module_for(sglang.__version__)
    assert [point.problem() for point in module.PATCH_POINTS if point.problem()] == []
    declared = {point.name for point in module.PATCH_POINTS}
    assert {target for target, _, _ in module.HOOKS} <= declared


@needs_supported
def test_hooks_register_once_per_process(no_flags):
    from sglang.srt.plugins.hook_registry import HookRegistry

    module = plugin.module_for(sglang.__version__)
    no_flags.setenv("KVCACHED_ENABLE", "1")
    plugin.register()
    plugin.register()
    plugin._installed.clear()
    plugin.register()  # a second install in the same process must not register twice
    for target, hook, _ in module.HOOKS:
        assert [h for _, h, _ in HookRegistry._hooks[target]].count(hook) == 1, target


# --------------------------------------------------------------------------- #
# Pools, allocators and admission (no model: driven as the scheduler drives them)
# --------------------------------------------------------------------------- #


@pytest.fixture
def v():
    if not SUPPORTED:
        pytest.skip(f"SGLang {sglang.__version__} is not supported")
    return plugin.module_for(sglang.__version__)


def _plan(v, name: str, limit_bytes=None):
    from kvcached.integration.common.rank_devices import describe_rank

    settings = Settings(virtual_bytes=None, policy=MemoryPolicy(max_bytes=limit_bytes), page_bytes=2 * MiB, name=name)
    return v.Plan(settings=settings, rank=describe_rank("cpu", 0), name=name, virtual_bytes=64 * MiB)


def _mha_pool(v, name: str, size: int, page_size: int, limit_bytes=None):
    with v.building(_plan(v, name, limit_bytes)):
        return v.KvcachedMHATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=torch.float32,
            head_num=4,
            head_dim=64,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )


class _Layer:
    layer_id = 0


@pytest.mark.parametrize("keep_bytes", [256 * MiB, 0])
def test_an_engine_on_the_cpu_keeps_its_freed_heap(v, monkeypatch, keep_bytes):
    plan_module = sys.modules[v.Plan.__module__]
    kept = []
    monkeypatch.setattr(plan_module, "keep_freed_heap", kept.append)
    settings = Settings(
        virtual_bytes=None, policy=MemoryPolicy(), page_bytes=2 * MiB, name="heap", host_heap_keep_bytes=keep_bytes
    )
    from kvcached.integration.common.rank_devices import describe_rank

    plan = v.Plan(settings=settings, rank=describe_rank("cpu", 0), name="heap", virtual_bytes=64 * MiB)
    with v.building(plan):
        v.KvcachedMHATokenToKVPool(
            size=1024,
            page_size=1,
            dtype=torch.float32,
            head_num=4,
            head_dim=64,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )
    assert kept == [keep_bytes]  # the setting as given: 0 leaves glibc as it is (keep_freed_heap's rule)


def test_mha_pool_buffers_are_views_of_a_kvcached_space(v):
    pool = _mha_pool(v, "mha-views", size=4096, page_size=1)
    space = pool.kvcached_blocks.space
    low, high = space.base_address, space.base_address + space.size_bytes
    for k, val in zip(pool.k_buffer, pool.v_buffer):
        assert k.shape == val.shape == (4097, 4, 64) and k.is_contiguous() and val.is_contiguous()
        for buf in (k, val):
            assert low <= buf.data_ptr() and buf.data_ptr() + buf.numel() * 4 <= high
    assert pool.v_buffer[0].data_ptr() - pool.k_buffer[0].data_ptr() == space.buffer_stride_bytes
    # SGLang's pointer tables (used by its copy kernels) point into the space too.
    assert pool.k_data_ptrs.tolist() == [b.data_ptr() for b in pool.k_buffer]

    allocator = v.KvcachedTokenToKVPoolAllocator(4096, torch.float32, "cpu", pool, False)
    assert allocator.available_size() == allocator.logical_available_size() == 4096
    loc = allocator.alloc(5)
    assert loc.tolist() == [1, 2, 3, 4, 5]  # slot 0 stays SGLang's padding slot
    key, value = torch.randn(5, 4, 64), torch.randn(5, 4, 64)
    pool.set_kv_buffer(_Layer(), loc, key, value)
    assert torch.equal(pool.get_key_buffer(0)[loc], key) and torch.equal(pool.get_value_buffer(0)[loc], value)
    assert allocator.available_size() == 4091
    allocator.free(loc)
    assert allocator.available_size() == 4096
    with pytest.raises(ValueError):
        allocator.free(loc)  # a double free is refused, not absorbed


def test_token_allocator_free_groups_and_clear(v):
    pool = _mha_pool(v, "token-groups", size=1024, page_size=1)
    allocator = v.KvcachedTokenToKVPoolAllocator(1024, torch.float32, "cpu", pool, False)
    a, b = allocator.alloc(10), allocator.alloc(10)
    allocator.free_group_begin()
    allocator.free(a)
    allocator.free(b[:5])
    assert allocator.logical_available_size() == 1004  # held until the group ends
    allocator.free_group_end()
    assert allocator.logical_available_size() == 1019
    allocator.clear()
    assert allocator.logical_available_size() == 1024 and pool.kvcached_blocks.stats()["used_blocks"] == 1


def test_paged_allocator_places_tokens_like_sglangs_own(v):
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    page, size = 16, 1024
    pool = _mha_pool(v, "paged-place", size=size, page_size=page)
    ours = v.KvcachedPagedTokenToKVPoolAllocator(size, page, torch.float32, "cpu", pool, False)
    stock_pool = MHATokenToKVPool(
        size=size,
        page_size=page,
        dtype=torch.float32,
        head_num=4,
        head_dim=64,
        layer_num=2,
        device="cpu",
        enable_memory_saver=False,
    )
    stock = PagedTokenToKVPoolAllocator(size, page, torch.float32, "cpu", stock_pool, False)

    def both(method, *args):
        return [
            getattr(a, method)(*[x.clone() if isinstance(x, torch.Tensor) else x for x in args]) for a in (ours, stock)
        ]

    def same_placement(x, y):
        # Same slot within each page, and one page of ours per page of SGLang's.
        assert torch.equal(x % page, y % page)
        pairs = set(zip((x // page).tolist(), (y // page).tolist()))
        assert len({p for p, _ in pairs}) == len({q for _, q in pairs}) == len(pairs)

    t = lambda *xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    prefix, seq = t(0, 0, 0), t(20, 5, 33)
    got, want = both("alloc_extend", prefix, prefix, seq, seq, t(-1, -1, -1), 58)
    same_placement(got, want)
    assert (got[:20] // page).unique().numel() == 2 and int(got.min()) >= page  # page 0 pads
    ends = torch.cumsum(seq, 0) - 1
    for _ in range(14):  # decode across page boundaries
        seq = seq + 1
        last = [got[ends], want[ends]]
        got_d, want_d = [a.alloc_decode(seq, seq, loc) for a, loc in zip((ours, stock), last)]
        same_placement(got_d, want_d)
        got, want, ends = got_d, want_d, torch.arange(3)
    assert ours.available_size() == size - page * 8  # 3 + 2 + 3 pages for 34, 19 and 47 tokens
    ours.free(torch.arange(page, 3 * page))  # pages 1 and 2
    assert ours.logical_available_size() == size - page * 6


def test_limit_makes_allocation_refuse_instead_of_raise(v):
    from kvcached.registry import registry_for

    pool = _mha_pool(v, "limited", size=16384, page_size=16)
    allocator = v.KvcachedPagedTokenToKVPoolAllocator(16384, 16, torch.float32, "cpu", pool, False)
    page_id_bytes = pool.kvcached_blocks.layout.page_bytes * 4  # 2 layers x K and V
    assert registry_for("cpu").set_policy("limited", max_bytes=2 * page_id_bytes) == 1
    tokens_per_page_id = pool.kvcached_blocks.layout.blocks_per_page * 16
    assert allocator.available_size() == 2 * tokens_per_page_id - 16  # page 0 holds the padding page
    assert allocator.logical_available_size() == 16384  # SGLang's conservation is unaffected
    taken = allocator.alloc(allocator.available_size())
    assert taken is not None and allocator.alloc(16) is None and allocator.available_size() == 0
    assert not allocator.secure_tokens(16)  # a check that cannot secure says no
    allocator.free(taken)
    assert allocator.secure_tokens(64) and allocator.secured_tokens() == 64
    assert allocator.available_size() == 2 * tokens_per_page_id - 16  # secured blocks still count
    allocator.end_step()
    assert allocator.secured_tokens() == 0


class _Tree:
    """The part of a radix cache the prefill budget reads."""

    def __init__(self, evictable: int = 0):
        self.evictable = evictable

    def evictable_size(self) -> int:
        return self.evictable

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return False


def test_prefill_admission_secures_memory_or_says_no(v):
    from kvcached.registry import registry_for

    pool = _mha_pool(v, "admission", size=16384, page_size=1)
    allocator = v.KvcachedTokenToKVPoolAllocator(16384, torch.float32, "cpu", pool, False)
    tokens_per_page_id = pool.kvcached_blocks.layout.blocks_per_page
    registry_for("cpu").set_policy("admission", max_bytes=2 * pool.kvcached_blocks.layout.page_bytes * 4)
    budget = allocator.create_prefill_budget(_Tree())
    assert isinstance(budget, v.KvcachedPrefillBudget)
    args = dict(max_new_tokens=16, input_tokens=0, swa_host_hit_length=0, chunk_limit=None)
    assert budget.check_prefill(extend_input_len=1000, total_tokens=1016, **args) == (True, None)
    assert allocator.secured_tokens() >= 1001  # admitted: its prefill memory is held
    budget.reserve(1000, 16)
    too_big = 2 * tokens_per_page_id
    assert budget.check_prefill(extend_input_len=too_big, total_tokens=too_big, **args)[0] is False
    loc = allocator.alloc(1000)  # the step's allocation takes the secured blocks
    assert loc is not None and allocator.secured_tokens() >= 1
    allocator.end_step()
    assert allocator.secured_tokens() == 0
    # Radix-cache entries are this engine's memory: they count, nothing is secured for them.
    budget = allocator.create_prefill_budget(_Tree(evictable=3000))
    assert budget.check_prefill(extend_input_len=2500, total_tokens=2516, **args)[0] is True


def test_mla_pool_latent_buffers_are_views_of_a_kvcached_space(v):
    with v.building(_plan(v, "mla")):
        pool = v.KvcachedMLATokenToKVPool(
            size=512,
            page_size=16,
            dtype=torch.bfloat16,
            kv_lora_rank=64,
            qk_rope_head_dim=32,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )
    space = pool.kvcached_blocks.space
    assert space.num_buffers == 1
    assert [tuple(b.shape) for b in pool.kv_buffer] == [(528, 1, 96)] * 2
    assert pool.kv_buffer[1].data_ptr() - pool.kv_buffer[0].data_ptr() == space.layer_stride_bytes
    allocator = v.KvcachedPagedTokenToKVPoolAllocator(512, 16, torch.bfloat16, "cpu", pool, False)
    loc = allocator.alloc(32)
    latent = torch.randn(32, 1, 96, dtype=torch.bfloat16)
    pool.kv_buffer[1][loc] = latent
    assert torch.equal(pool.get_key_buffer(1)[loc], latent)


def test_last_request_waits_for_memory_instead_of_being_aborted(v, monkeypatch):
    import threading

    from kvcached.registry import registry_for

    monkeypatch.setattr(v.allocators, "LAST_REQUEST_WAIT_S", 0.5)
    pool = _mha_pool(v, "last-request", size=16384, page_size=1)
    allocator = v.KvcachedTokenToKVPoolAllocator(16384, torch.float32, "cpu", pool, False)
    page_id_bytes = pool.kvcached_blocks.layout.page_bytes * 4
    registry = registry_for("cpu")
    registry.set_policy("last-request", max_bytes=page_id_bytes)
    held = allocator.alloc(allocator.available_size())
    tree = _Tree()
    # Several requests: SGLang retracts one and asks again, no waiting.
    assert not allocator.check_decode_capacity(num_tokens=2, tree_cache=tree, requests=[1, 2])
    # The last one: memory comes back (here: the limit is raised) while it waits.
    threading.Timer(0.1, registry.set_policy, args=("last-request",), kwargs={"max_bytes": 2 * page_id_bytes}).start()
    assert allocator.check_decode_capacity(num_tokens=1, tree_cache=tree, requests=[1])
    allocator.end_step()
    allocator.free(held)


def test_unsupported_configurations_are_refused_before_sizing(v, caplog):
    from types import SimpleNamespace

    server_args = SimpleNamespace(
        tp_size=2,
        pp_size=2,
        dp_size=2,
        speculative_algorithm="EAGLE",
        enable_hierarchical_cache=False,
        disaggregation_mode="null",
        kv_cache_dtype="auto",
        model_path="/m/llama",
    )
    model = SimpleNamespace(head_dim=64, v_head_dim=64)
    configurator = SimpleNamespace(
        server_args=server_args,
        model_config=model,
        is_draft_worker=False,
        is_hybrid_swa=False,
        mambaish_config=None,
        use_mla_backend=False,
        post_capture_kv_active=False,
        device="cpu",
        gpu_id=0,
    )
    server_args.enable_dp_attention = True
    # Tensor and pipeline ranks and data-parallel replicas are served (test_sglang_parallel.py); DP attention is not.
    assert v.refusals(configurator) == ["DP attention", "speculative decoding"]
    with caplog.at_level(logging.ERROR, logger="kvcached.integration.sglang"):
        assert v.plan_for(configurator) is None
        assert v.plan_for(configurator) is None  # decided once
    assert caplog.text.count("kvcached is NOT active for this engine") == 1
    assert "DP attention, speculative decoding" in caplog.text
    server_args.enable_dp_attention, server_args.speculative_algorithm = False, None
    assert v.refusals(configurator) == []


def test_idle_engine_holds_its_memory_until_the_hold_ends_or_the_device_wants_it(v):
    import threading
    import time
    from types import SimpleNamespace

    import zmq

    from kvcached.integration.common.idle import IdleRelease

    pool = _mha_pool(v, "idle-hold", size=16384, page_size=1)
    allocator = v.KvcachedTokenToKVPoolAllocator(16384, torch.float32, "cpu", pool, False)
    device = SimpleNamespace(pressure_bytes=0, external_limit_bytes=None, mapped_bytes=0)
    allocator.idle = IdleRelease(0.3, [device])
    blocks_per_page_id = pool.kvcached_blocks.layout.blocks_per_page
    sleeper = SimpleNamespace(poller=zmq.Poller())  # SGLang's IdleSleeper: its poller, here with no sockets
    scheduler = SimpleNamespace(
        token_to_kv_pool_allocator=allocator, tree_cache=None, idle_sleeper=sleeper, is_fully_idle=lambda: True
    )
    slept = []

    def sleep_as_sglang(s):  # SGLang's maybe_sleep_on_idle, with a 0.5 s timeout instead of 1 s
        start = time.monotonic()
        s.idle_sleeper.poller.poll(500)
        slept.append(time.monotonic() - start)

    def mapped_pages() -> int:
        return pool.kvcached_blocks.stats()["mapped_pages"]

    allocator.free(allocator.alloc(2 * blocks_per_page_id))  # a burst's memory, free but mapped
    held = mapped_pages()
    assert held >= 2
    v._hook_sleep_on_idle(sleep_as_sglang, scheduler)  # holding: the sleep ends when the 0.3 s hold does
    assert 0.2 < slept[-1] < 0.45 and mapped_pages() == held
    v._hook_sleep_on_idle(sleep_as_sglang, scheduler)  # due: memory back, then SGLang's own full sleep
    assert mapped_pages() == 1 and slept[-1] >= 0.45  # only the padding page; the wake-up was drained
    assert allocator.kvcached_stats()["idle_early_releases"] == 0

    # Work starts a new idle period; another instance's refusal ends the (long) hold at once.
    allocator.idle.close()
    allocator.idle = IdleRelease(600.0, [device])
    allocator.free(allocator.alloc(2 * blocks_per_page_id))
    threading.Timer(0.1, setattr, args=(device, "pressure_bytes", 1)).start()
    v._hook_sleep_on_idle(sleep_as_sglang, scheduler)
    assert slept[-1] < 0.4 and mapped_pages() >= 2
    v._hook_sleep_on_idle(sleep_as_sglang, scheduler)
    assert mapped_pages() == 1 and allocator.kvcached_stats()["idle_early_releases"] == 1
    allocator.idle.close()


def test_prefill_refused_for_memory_says_the_engine_waits(v):
    from kvcached.registry import registry_for

    pool = _mha_pool(v, "prefill-wants", size=16384, page_size=1)
    allocator = v.KvcachedTokenToKVPoolAllocator(16384, torch.float32, "cpu", pool, False)
    wanted = []
    allocator.kvcached_blocks.want_more = lambda: wanted.append(1)
    registry_for("cpu").set_policy("prefill-wants", max_bytes=pool.kvcached_blocks.layout.page_bytes * 4)
    budget = allocator.create_prefill_budget(_Tree())
    args = dict(max_new_tokens=16, input_tokens=0, swa_host_hit_length=0, chunk_limit=None)
    assert budget.check_prefill(extend_input_len=100, total_tokens=116, **args)[0] is True
    assert wanted == []
    too_big = 2 * pool.kvcached_blocks.layout.blocks_per_page
    assert budget.check_prefill(extend_input_len=too_big, total_tokens=too_big, **args)[0] is False
    assert wanted == [1]  # SGLang said no from available_size(): idle engines on the device hear of it
