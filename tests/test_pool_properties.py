"""Model-based property test: with the background worker on, after every step of any sequence of
alloc / free / resize / trim / clear / maintain, ``available()`` and ``stats()`` agree exactly with a
model of the pool — no settling sleeps. The worker may be mapping or unmapping at any moment; what
the pool reports must not depend on it."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvcached
from kvcached import _core

BLOCK_BYTES = 4 << 10
PAGE_BYTES = 16 << 10  # 4 blocks per page
NUM_BLOCKS = 46  # 12 pages, the last one holding 2 blocks
NUM_LAYERS = 2


class PoolMachine(RuleBasedStateMachine):
    """The model: the ids handed out, the limit and the budget in pages."""

    @initialize(
        layout=st.sampled_from(["per_layer", "contiguous"]),
        null_block=st.booleans(),
        budget_pages=st.integers(min_value=3, max_value=14),
        placement=st.sampled_from(["fewest_pages", "fullest_first"]),
    )
    def open_pool(self, layout: str, null_block: bool, budget_pages: int, placement: str) -> None:
        self.device = _core.open_host_device(64 << 20)
        kv_layout = kvcached.KVLayout(NUM_LAYERS, BLOCK_BYTES, NUM_BLOCKS, page_bytes=PAGE_BYTES, kind=layout)
        self.budget = _core.FixedBudget(budget_pages * kv_layout.page_id_bytes)
        options = kvcached.BlockManagerOptions(
            null_block=null_block,
            min_free_pages=1,
            max_free_pages=2,
            max_spare_pages=2,
            background_worker=True,
            placement=placement,
        )
        self.pool = kvcached.KVPool(kv_layout=kv_layout, options=options, device=self.device, budget=self.budget)
        self.per_page = kv_layout.blocks_per_page
        self.num_pages = kv_layout.num_pages
        self.capacity = [kv_layout.blocks_on_page(p) for p in range(self.num_pages)]
        self.null_block = null_block
        self.used: set[int] = {0} if null_block else set()
        self.limit_pages = self.num_pages
        self.budget_pages = budget_pages

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            self.pool.close()
            counters = self.device.counters()
            assert counters["mapped_bytes"] == 0 and counters["created_bytes"] == 0
            assert self.budget.used_bytes == 0

    # ---- the model ------------------------------------------------------------------------

    def handed_out(self) -> list[int]:
        return sorted(self.used - ({0} if self.null_block else set()))

    def pages_in_use(self) -> set[int]:
        return {i // self.per_page for i in self.used}

    def model_available(self) -> int:
        used_pages = self.pages_in_use()
        free_on_used = sum(self.capacity[p] for p in used_pages) - len(self.used)
        candidates = [p for p in range(self.num_pages) if p not in used_pages]
        pages = min(len(candidates), self.limit_pages - len(used_pages), self.budget_pages - len(used_pages))
        pages = max(pages, 0)
        if pages == len(candidates):
            blocks = sum(self.capacity[p] for p in candidates)
        else:
            blocks = pages * self.per_page  # whole pages are chosen before the short last one
        return free_on_used + blocks

    # ---- steps ------------------------------------------------------------------------------

    @rule(n=st.integers(min_value=0, max_value=24))
    def alloc(self, n: int) -> None:
        expected = self.model_available()
        used_before = self.pool.stats()["used_blocks"]
        if n > expected:
            with pytest.raises(kvcached.OutOfMemoryError):
                self.pool.alloc(n)
            assert self.pool.stats()["used_blocks"] == used_before, "a failed alloc changed the pool"
            return
        ids = self.pool.alloc(n).tolist()
        assert len(ids) == n and len(set(ids)) == n
        assert not self.used & set(ids), "an id was handed out twice"
        assert all(0 <= i < NUM_BLOCKS for i in ids)
        self.used |= set(ids)

    @precondition(lambda self: len(self.handed_out()) > 0)
    @rule(data=st.data())
    def free(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.handed_out()), min_size=1, unique=True))
        self.pool.free(ids)
        self.used -= set(ids)

    @rule(data=st.data())
    def free_something_not_allocated(self, data) -> None:
        free_ids = sorted(set(range(NUM_BLOCKS)) - self.used)
        if not free_ids:
            return
        bad = data.draw(st.sampled_from(free_ids))
        extra = self.handed_out()[:1]
        used_before = self.pool.stats()["used_blocks"]
        with pytest.raises(ValueError):
            self.pool.free(extra + [bad])
        assert self.pool.stats()["used_blocks"] == used_before

    @rule(pages=st.one_of(st.none(), st.integers(min_value=0, max_value=14)))
    def resize(self, pages) -> None:
        holds = self.pool.resize(None if pages is None else pages * self.pool.page_id_bytes)
        self.limit_pages = self.num_pages if pages is None else min(pages, self.num_pages)
        assert holds == (len(self.pages_in_use()) <= self.limit_pages), "resize() misreported a deferred shrink"

    @rule()
    def trim(self) -> None:
        self.pool.trim()
        stats = self.pool.stats()
        # Everything free is given back, and the worker keeps it so until the next alloc.
        assert stats["mapped_pages"] == len(self.pages_in_use()) and stats["spare_pages"] == 0

    @rule()
    def clear(self) -> None:
        self.pool.clear()
        self.used = {0} if self.null_block else set()

    @rule()
    def maintain(self) -> None:
        self.pool.maintain()
        stats = self.pool.stats()
        assert stats["mapped_pages"] <= len(self.pages_in_use()) + 2

    # ---- after every step -------------------------------------------------------------------

    @invariant()
    def available_and_stats_agree_with_the_model(self) -> None:
        if not hasattr(self, "pool"):
            return
        assert self.pool.available() == self.model_available()
        s = self.pool.stats()
        assert s["used_blocks"] == len(self.used)
        assert s["used_pages"] == len(self.pages_in_use())
        states = ("used_pages", "free_pages", "mapping_pages", "unmapping_pages", "pending_pages", "unmapped_pages")
        assert sum(s[k] for k in states) == s["num_pages"] == self.num_pages
        assert s["pending_pages"] == 0  # only mirrors acknowledge
        assert s["mapped_pages"] == s["used_pages"] + s["free_pages"]
        free_on_used = sum(self.capacity[p] for p in self.pages_in_use()) - len(self.used)
        free_on_free_pages = s["free_mapped_blocks"] - free_on_used  # the reserve: the worker's to vary
        assert 0 <= free_on_free_pages <= s["free_pages"] * self.per_page
        assert self.budget.used_bytes <= self.budget_pages * self.pool.page_id_bytes


PoolMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPool = PoolMachine.TestCase


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    layout=st.sampled_from(["per_layer", "contiguous"]),
    num_layers=st.integers(1, 3),
    device_bytes=st.integers(1, 16 * 4 * PAGE_BYTES * 3),
    budget_pages=st.none() | st.integers(0, 14),
    limit_pages=st.none() | st.integers(0, 14),
    first=st.integers(0, 20),
    worker=st.booleans(),
)
def test_alloc_of_what_available_reports_succeeds_whatever_binds(
    layout, num_layers, device_bytes, budget_pages, limit_pages, first, worker
):
    """available() applies every bound alloc applies (device memory, budget, limit, page ids), so an
    alloc of what it reports succeeds and one block more is refused, before and after other allocs."""
    kv_layout = kvcached.KVLayout(num_layers, BLOCK_BYTES, NUM_BLOCKS, page_bytes=PAGE_BYTES, kind=layout)
    page = kv_layout.page_id_bytes
    device = _core.open_host_device(-(-device_bytes // 4096) * 4096)  # whole host pages
    budget = None if budget_pages is None else _core.FixedBudget(budget_pages * page + page // 3)
    with kvcached.KVPool(
        kv_layout=kv_layout,
        device=device,
        budget=budget,
        limit_bytes=None if limit_pages is None else limit_pages * page + page // 2,
        background_worker=worker,
        register=False,
    ) as pool:
        held = []
        for count in (min(first, pool.available()), None):
            n = pool.available() if count is None else count
            held.append(pool.alloc(n))
        assert pool.available() == 0
        with pytest.raises(kvcached.OutOfMemoryError):
            pool.alloc(1)
        for ids in held:
            pool.free(ids)
