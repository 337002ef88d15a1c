"""A busy SGLang engine over its limit in force: the decision, driven as the scheduler drives it.

No model: a kvcached allocator of SGLang's, a radix cache reduced to its eviction (least
recently used slots first, freed through the allocator as SGLang's are), and the limit
lowered through the registry as a higher priority's reclaim target or ``kvctl set-limit``
lowers it. The engine with a real model is ``test_sglang_policy.py``.
"""

from __future__ import annotations

import pytest

from kvcached.testing.sglang_env import require_sglang

sglang = require_sglang()
import torch  # noqa: E402  (SGLang needs it)

from kvcached.integration import sglang as plugin  # noqa: E402
from kvcached.integration.common.rank_devices import describe_rank  # noqa: E402
from kvcached.integration.common.settings import Settings  # noqa: E402
from kvcached.registry import MemoryPolicy, registry_for  # noqa: E402

pytestmark = pytest.mark.sglang
MiB = 1 << 20


@pytest.fixture
def v():
    if plugin.POLICY.release_of(sglang.__version__) not in plugin.POLICY.releases:
        pytest.skip(f"SGLang {sglang.__version__} is not supported")
    return plugin.module_for(sglang.__version__)


class _LruTree:
    """A radix cache's eviction: unreferenced cached slots, freed oldest first through the allocator."""

    def __init__(self, allocator, cached: torch.Tensor):
        self.allocator, self.cached = allocator, cached

    def supports_prefix_sharing(self) -> bool:
        return True

    def evictable_size(self) -> int:
        return len(self.cached)

    def evict(self, params) -> None:
        count = min(params.num_tokens, len(self.cached))
        self.allocator.free(self.cached[:count])
        self.cached = self.cached[count:]


def _allocator(v, name: str):
    settings = Settings(virtual_bytes=None, policy=MemoryPolicy(), page_bytes=2 * MiB, name=name)
    plan = v.Plan(settings=settings, rank=describe_rank("cpu", 0), name=name, virtual_bytes=64 * MiB)
    with v.building(plan):
        pool = v.KvcachedMHATokenToKVPool(
            size=16384,
            page_size=1,
            dtype=torch.float32,
            head_num=4,
            head_dim=64,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )
    allocator = v.KvcachedTokenToKVPoolAllocator(16384, torch.float32, "cpu", pool, False)
    page_id_bytes = pool.kvcached_blocks.layout.page_bytes * 4  # 2 layers x K and V
    tokens_per_page_id = pool.kvcached_blocks.layout.blocks_per_page  # 2048 slots
    return allocator, page_id_bytes, tokens_per_page_id


def _mapped(name: str) -> int:
    return next(e["mapped_bytes"] for e in registry_for("cpu").entries() if e["name"] == name and e["alive"])


def test_within_its_limit_an_engine_evicts_nothing(v):
    allocator, _, _ = _allocator(v, "shrink-within")
    in_use = allocator.alloc(3000)
    tree = _LruTree(allocator, allocator.alloc(2000))
    assert allocator.pages_over_limit() == 0
    assert v.shrink.evict_while_over(allocator, tree) == 0
    assert tree.evictable_size() == 2000  # the cache stays: nobody asked for memory
    assert allocator.check_decode_capacity(num_tokens=2, tree_cache=tree, requests=[1, 2])
    allocator.end_step()
    allocator.free(in_use)


def test_over_its_limit_cached_prefixes_go_first_and_their_pages_at_the_steps_end(v):
    allocator, page_id_bytes, _ = _allocator(v, "shrink-cache")
    in_use = allocator.alloc(3000)  # with the padding slot: page ids 0 and 1
    tree = _LruTree(allocator, allocator.alloc(5000))  # page ids 1 to 3
    allocator.end_step()
    assert _mapped("shrink-cache") >= 4 * page_id_bytes
    registry_for("cpu").set_policy("shrink-cache", max_bytes=3 * page_id_bytes)
    assert allocator.pages_over_limit() == 1
    assert v.shrink.evict_while_over(allocator, tree) == 0 and allocator.pages_over_limit() == 0
    assert 0 < tree.evictable_size() < 5000  # the oldest cached slots went, as many as needed
    # No request need make way: the decode check secures as usual.
    assert allocator.check_decode_capacity(num_tokens=2, tree_cache=tree, requests=[1, 2])
    allocator.end_step()
    assert _mapped("shrink-cache") <= 3 * page_id_bytes  # given back in this step, not when idle
    allocator.free(in_use)


def test_still_over_after_the_cache_the_decode_check_has_sglang_retract(v):
    allocator, page_id_bytes, tokens_per_page_id = _allocator(v, "shrink-retract")
    first, second = allocator.alloc(1500), allocator.alloc(2500)  # two requests: page ids 0 and 1
    tree = _LruTree(allocator, allocator.alloc(500))
    allocator.end_step()
    registry_for("cpu").set_policy("shrink-retract", max_bytes=page_id_bytes)
    # The whole cache goes, and it is not enough: with two running, SGLang retracts one.
    assert v.shrink.evict_while_over(allocator, tree) == 1 and tree.evictable_size() == 0
    assert not allocator.check_decode_capacity(num_tokens=2, tree_cache=tree, requests=[1, 2])
    allocator.free(second)  # SGLang retracted the second request: its slots are free
    assert allocator.pages_over_limit() == 0
    assert allocator.check_decode_capacity(num_tokens=2, tree_cache=tree, requests=[1])
    allocator.end_step()
    assert _mapped("shrink-retract") <= page_id_bytes
    assert allocator.alloc(tokens_per_page_id) is None  # the limit holds
    allocator.free(first)
