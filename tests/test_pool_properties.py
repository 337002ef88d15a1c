"""Property test: any sequence of alloc / free / resize / trim / maintain agrees with a simple model."""

from __future__ import annotations

import pytest

pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import kvcached
from kvcached import _core

BLOCK_BYTES = 4 << 10
PAGE_BYTES = 16 << 10  # 4 blocks per page
NUM_BLOCKS = 48
MAX_RESERVE_PAGES = 2


class PoolMachine(RuleBasedStateMachine):
    """The model: the set of ids handed out and the limit in pages (None: none)."""

    @initialize(layout=st.sampled_from(["per_layer", "contiguous"]), null_block=st.booleans())
    def open_pool(self, layout: str, null_block: bool) -> None:
        self.device = _core.open_host_device(64 << 20)
        self.pool = kvcached.KVPool(2, BLOCK_BYTES, num_blocks=NUM_BLOCKS, page_bytes=PAGE_BYTES, layout=layout,
                                    device=self.device, null_block=null_block, background_worker=False,
                                    min_reserve_pages=1, max_reserve_pages=MAX_RESERVE_PAGES)
        self.per_page = self.pool.blocks_per_page
        self.used: set[int] = {0} if null_block else set()
        self.null_block = null_block
        self.limit_pages = None

    def teardown(self) -> None:
        if hasattr(self, "pool"):
            self.pool.close()
            counters = self.device.counters()
            assert counters["mapped_bytes"] == 0 and counters["created_bytes"] == 0

    def handed_out(self) -> list[int]:
        return sorted(self.used - ({0} if self.null_block else set()))

    @rule(n=st.integers(min_value=0, max_value=20))
    def alloc(self, n: int) -> None:
        available = self.pool.available()
        before = self.pool.stats()
        if n > available:
            with pytest.raises(kvcached.OutOfMemoryError):
                self.pool.alloc(n)
            assert self.pool.stats() == before, "a failed alloc changed the pool"
            return
        ids = self.pool.alloc(n).tolist()
        assert len(ids) == n and len(set(ids)) == n
        assert not self.used & set(ids), "an id was handed out twice"
        assert all(0 <= i < self.pool.num_blocks for i in ids)
        self.used |= set(ids)

    @precondition(lambda self: len(self.handed_out()) > 0)
    @rule(data=st.data())
    def free(self, data) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.handed_out()), min_size=1, unique=True))
        self.pool.free(ids)
        self.used -= set(ids)

    @rule(data=st.data())
    def free_something_not_allocated(self, data) -> None:
        free_ids = sorted(set(range(self.pool.num_blocks)) - self.used)
        if not free_ids:
            return
        bad = data.draw(st.sampled_from(free_ids))
        extra = self.handed_out()[:1]
        before = self.pool.stats()
        with pytest.raises(ValueError):
            self.pool.free(extra + [bad])
        assert self.pool.stats() == before

    @rule(pages=st.one_of(st.none(), st.integers(min_value=0, max_value=NUM_BLOCKS // 4 + 1)))
    def resize(self, pages) -> None:
        self.pool.resize(None if pages is None else pages * self.pool.page_id_bytes)
        self.limit_pages = pages

    @rule()
    def trim(self) -> None:
        self.pool.trim()
        assert self.pool.stats()["mapped_pages"] == self.pages_in_use()

    @rule()
    def maintain(self) -> None:
        self.pool.maintain()
        stats = self.pool.stats()
        assert stats["mapped_pages"] <= self.pages_in_use() + MAX_RESERVE_PAGES
        if self.limit_pages is not None:
            assert stats["mapped_pages"] + stats["spare_pages"] <= max(self.limit_pages, self.pages_in_use())

    def pages_in_use(self) -> int:
        return len({i // self.per_page for i in self.used})

    @invariant()
    def counters_agree_with_the_model(self) -> None:
        if not hasattr(self, "pool"):
            return
        stats = self.pool.stats()
        assert stats["used_blocks"] == len(self.used)
        assert stats["used_pages"] == self.pages_in_use()
        available = self.pool.available()
        assert 0 <= available <= self.pool.num_blocks - len(self.used)
        assert stats["free_mapped_blocks"] <= available
        assert self.device.counters()["mapped_bytes"] == stats["mapped_bytes"]


PoolMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPool = PoolMachine.TestCase
