"""What the allocator reports is what is there: one test per rule, with the background worker on."""

from __future__ import annotations

import time

import kvcached
from kvcached import _core

BLOCK_SIZE, CELL_SIZE = 16, 256  # 4 KiB blocks per layer buffer
NUM_LAYERS = 2


def make_manager(num_blocks: int, *, page_bytes: int = 16 << 10, device=None, **kwargs) -> kvcached.KVCacheManager:
    return kvcached.KVCacheManager(
        num_blocks,
        BLOCK_SIZE,
        CELL_SIZE,
        NUM_LAYERS,
        page_bytes=page_bytes,
        device=device or _core.open_host_device(256 << 20),
        **kwargs,
    )


def test_freed_blocks_are_allocatable_at_once_while_the_worker_unmaps():
    """1. A finished batch is re-admitted at once: no "no memory" while pages are in transit."""
    with make_manager(800) as m:  # 200 pages of 4 blocks; the worker keeps at most 4 free
        for _ in range(20):
            ids = m.alloc(768)
            assert ids is not None
            m.free(ids)
            assert m.available_size() == 800, m.stats()
            again = m.alloc(768)
            assert again is not None, m.stats()
            m.free(again)


def test_stats_say_where_every_page_is():
    """1. Every page id is in exactly one state, and pages being unmapped are not counted as used."""
    with make_manager(800) as m:
        ids = m.alloc(768)
        m.free(ids)
        for _ in range(200):
            s = m.stats()
            states = ("used_pages", "free_pages", "mapping_pages", "unmapping_pages", "pending_pages", "unmapped_pages")
            assert sum(s[k] for k in states) == s["num_pages"], s
            assert s["used_pages"] == 0 and s["used_blocks"] == 0, s
            assert s["mapped_pages"] == s["used_pages"] + s["free_pages"]


def test_no_page_stays_pinned_when_num_blocks_is_not_whole_pages():
    """2. The block manager knows num_blocks: the last, partial page is given back like any other."""
    with make_manager(30, background_worker=False) as m:  # 7.5 pages of 4 blocks
        assert m.pool.num_blocks == 30
        ids = m.alloc(30)
        assert sorted(ids) == list(range(30))
        assert m.alloc(1) is None
        m.free(ids)
        m.trim()
        assert m.stats()["mapped_pages"] == 0 and m.get_mapped_memory_size() == 0
        ids = m.alloc(30)
        m.clear()
        m.trim()
        assert m.stats()["mapped_pages"] == 0
        assert "parked_blocks" not in m.stats()


def test_a_run_that_fits_one_page_lands_on_one_page_and_single_blocks_fill_holes():
    """3. Runs share as few pages as possible; single blocks go into the fullest pages."""
    # 64 blocks per page: 256 KiB pages of 4 KiB blocks.
    with make_manager(64 * 8, page_bytes=256 << 10, background_worker=False) as m:
        per_page = m.pool.blocks_per_page
        assert per_page == 64
        held = m.alloc(7 * per_page)
        by_page: dict[int, list[int]] = {}
        for b in held:
            by_page.setdefault(m.pool.page_of(b), []).append(b)
        pages = sorted(by_page)
        m.free(by_page[pages[-1]])  # one page entirely free, kept mapped (the reserve)
        holes = []
        for page in pages[:-1]:  # six pages with a hole of 7 blocks each
            holes += by_page[page][:7]
        m.free(holes)
        run = m.alloc(40)
        assert len({m.pool.page_of(b) for b in run}) == 1, "a 40-block run was spread over several pages"
        single = m.alloc(1)
        assert m.pool.page_of(single[0]) in pages[:-1], "a single block did not fill a hole"
        # Once the neighbours finish, the run keeps one page mapped.
        m.free([b for b in held if b not in holes and b not in by_page[pages[-1]]])
        m.free(single)
        m.trim()
        assert m.stats()["mapped_pages"] == 1


def test_trim_is_not_undone_while_idle_and_the_reserve_refills_when_allocation_resumes():
    """4. trim() gives everything back; the worker refills the reserve only once alloc is called again."""
    with make_manager(64) as m:
        pool = m.pool
        m.free(m.alloc(10))
        m.trim()
        assert pool.stats()["mapped_pages"] == 0
        for _ in range(5):  # rounds of what the worker does, plus the worker itself for several periods
            pool.maintain()
        time.sleep(0.3)
        s = pool.stats()
        assert s["mapped_pages"] == 0 and s["spare_pages"] == 0, s
        ids = m.alloc(1)
        deadline = time.monotonic() + 5
        while pool.stats()["free_pages"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pool.stats()["free_pages"] >= 1, "the reserve did not refill once allocation resumed"
        m.free(ids)


def test_try_to_reserve_guarantees_the_next_alloc():
    """5. Reserved blocks are handed out first, so the next alloc of that size succeeds."""
    with make_manager(32, background_worker=False) as m:
        assert m.try_to_reserve(12)
        assert m.available_size() == 32  # reserved blocks still count as available
        others = m.alloc(20)  # takes the 12 reserved ones first, then 8 more
        assert others is not None
        assert m.available_size() == 12
        assert m.try_to_reserve(12)
        assert m.available_size() == 12
        m.pool.resize(m.stats()["mapped_bytes"])  # nothing more may be mapped
        got = m.alloc(12)
        assert got is not None and len(got) == 12
        assert m.stats()["reserved_blocks"] == 0
        m.free(got)
        m.free(others)


def test_free_reserved_gives_the_blocks_back():
    with make_manager(32, background_worker=False) as m:
        assert m.try_to_reserve(10)
        assert m.stats()["reserved_blocks"] == 10
        m.free_reserved()
        assert m.stats()["reserved_blocks"] == 0 and m.stats()["used_blocks"] == 0
        assert m.available_size() == 32


def test_resize_says_false_when_the_shrink_is_deferred():
    """6. resize() is True when the limit holds now, False when it waits for frees."""
    block_bytes = BLOCK_SIZE * CELL_SIZE
    with make_manager(32, background_worker=False) as m:
        assert m.resize(8 * block_bytes) is True  # nothing in use: holds at once
        ids = m.alloc(8)
        assert m.resize(4 * block_bytes) is False  # 8 blocks in use, limit of 4: deferred
        m.free(ids[4:])
        assert m.resize(4 * block_bytes) is True
        assert m.resize(None) is True
        m.free(ids[:4])


def test_resize_deferred_frees_reserved_blocks_first():
    block_bytes = BLOCK_SIZE * CELL_SIZE
    with make_manager(32, background_worker=False) as m:
        assert m.try_to_reserve(8)
        assert m.resize(4 * block_bytes) is True  # the reservation is released, then the limit holds
        assert m.stats()["reserved_blocks"] == 0


def test_available_size_is_exact_at_once_after_free_with_the_worker_on():
    """1. available_size() never reads short: the same figure right after free as before alloc."""
    with make_manager(200) as m:
        before = m.available_size()
        for n in (3, 17, 64, 150):
            ids = m.alloc(n)
            assert m.available_size() == before - n
            m.free(ids)
            assert m.available_size() == before


def test_a_limit_set_from_outside_shows_in_available_at_once():
    """kvctl set-limit (the registry) is read by available() itself, worker or not."""
    from kvcached.registry import registry_for

    with make_manager(64, background_worker=False, name="truth-limit") as m:
        assert m.available_size() == 64
        page_id_bytes = m.pool.page_id_bytes
        registry_for(m.pool.device.name).set_policy("truth-limit", max_bytes=2 * page_id_bytes)
        assert m.available_size() == 2 * m.pool.blocks_per_page
        assert m.alloc(2 * m.pool.blocks_per_page + 1) is None
        registry_for(m.pool.device.name).set_policy("truth-limit", clear_max=True)
        assert m.available_size() == 64
