"""kvcached's options: one table, each overridable by one ``KVCACHED_*`` environment variable.

This table is the only place an option's default, its values and its meaning are written:
``docs/configuration.md`` is generated from it (``python -m kvcached.config_doc --write``; a
test fails when they differ), and the C++ core reads no environment variable: Python passes
it the values from here when it opens a device or a registry. Values are read when a pool (or
device budget) is created, so a process can set them before it builds its KV cache.
"""

from __future__ import annotations

from typing import Optional

from kvcached.option_values import (
    AbsolutePath,
    Boolean,
    Choice,
    Count,
    Fraction,
    GroupName,
    InstanceName,
    Integer,
    Option,
    Seconds,
    Size,
)

LAYOUTS = ("per_layer", "contiguous")
HOST_MEMORY_KINDS = ("anonymous", "huge_pages", "shared_files")
HOST_POPULATE_WAYS = ("background", "on_touch")

OPTIONS: dict[str, Option] = {
    "page_bytes": Option(
        "KVCACHED_PAGE_BYTES",
        0,
        Size(minimum=4 << 10, maximum=1 << 30, multiple_of=4 << 10, zero_means="the device's recommended granularity"),
        "Page size per layer and buffer; a multiple of the device granularity and of the block size.",
        read_by="pools",
        default_note="device granularity: 2 MiB on CUDA and host",
    ),
    "layout": Option(
        "KVCACHED_LAYOUT",
        None,
        Choice(LAYOUTS),
        (
            "`per_layer`: each layer's K and V blocks packed (`2·L` allocations per page id). "
            "`contiguous`: one compound page per page id spanning all layers (O(1) driver calls to grow)."
            " Why contiguous by default: below. The vLLM and SGLang integrations choose the layout from "
            "the engine's own tensor strides, not from this option."
        ),
        read_by="pools",
        default_note=(
            "the device kind's default, `contiguous` on CUDA, HIP and host "
            "(`kvcached.layout.DEFAULT_LAYOUTS`; `kvcached info` shows it)"
        ),
    ),
    "zero_backing": Option(
        "KVCACHED_ZERO_BACKING",
        True,
        Boolean(),
        "Unmapped regions read as zeros, so stray reads by kernels never fault.",
        read_by="pools",
    ),
    "zero_chunk_bytes": Option(
        "KVCACHED_ZERO_CHUNK_BYTES",
        256 << 20,
        Size(minimum=4 << 10),
        (
            "Largest zero-filled allocation used for zero backing on GPUs; one set per device and "
            "process, shared by its pools."
        ),
        read_by="pools",
    ),
    "min_reserve_pages": Option(
        "KVCACHED_MIN_RESERVE_PAGES",
        1,
        Count(),
        "Mapped free pages the background worker keeps ready, so `alloc` rarely waits on the driver.",
        read_by="pools",
    ),
    "max_reserve_pages": Option(
        "KVCACHED_MAX_RESERVE_PAGES",
        4,
        Count(),
        "Mapped free pages beyond which the worker gives memory back.",
        read_by="pools",
    ),
    "min_spare_pages": Option(
        "KVCACHED_MIN_SPARE_PAGES",
        1,
        Count(),
        (
            "Pre-created (unmapped) physical allocations, in page ids, that the worker keeps ready, so a "
            "grow maps without creating (`cuMemCreate` off the path). Counted in the pool's budget."
        ),
        read_by="pools",
    ),
    "max_spare_pages": Option(
        "KVCACHED_MAX_SPARE_PAGES",
        2,
        Count(),
        (
            "Unmapped allocations kept for reuse. A shrink keeps everything it unmaps as spares, so it "
            "never waits for `cuMemRelease`; the worker's next round (within 50 ms) releases what is "
            "beyond this many, and releases at once when other pools wait for memory, under a limit, on "
            "`trim()` and at close. Spares are counted in the budget. The KV spaces of engine ranks that "
            "do not decide blocks (vLLM's workers) keep none: their budget is released when they "
            "acknowledge an unmap."
        ),
        read_by="pools",
    ),
    "zero_frontier_pages": Option(
        "KVCACHED_ZERO_FRONTIER_PAGES",
        64,
        Count(),
        (
            "Unmapped page ids kept split ahead of use, so a grow never splits a zero chunk: set-up "
            "splits the first ones (up to 512 allocations' worth: 64 page ids contiguous, 8 per-layer "
            "with 32 layers), the worker keeps at least this many ready, and twice the largest of the "
            "last 16 grows. Costs a zero mapping per allocation (no memory)."
        ),
        read_by="pools (GPU zero backing)",
    ),
    "gpu_utilization": Option(
        "KVCACHED_GPU_UTILIZATION",
        0.9,
        Fraction(),
        (
            "Share of device memory, in (0, 1], that the kvcached instances of one GPU may map together "
            "(the registry's budget). Checked on every device, host included."
        ),
        read_by="device registry",
    ),
    "virtual_capacity_bytes": Option(
        "KVCACHED_VIRTUAL_CAPACITY_BYTES",
        0,
        Size(zero_means="the device's total memory"),
        "Virtual KV capacity of a pool given neither `num_blocks` nor `capacity_bytes`.",
        read_by="pools, vLLM integration",
        default_note="the device's total memory",
    ),
    "host_capacity_bytes": Option(
        "KVCACHED_HOST_CAPACITY_BYTES",
        None,
        Size(minimum=4 << 10),
        (
            "Bytes of physical memory the host backend may create; a size, more than 0. The low-level "
            "`kvcached._core.open_host_device(capacity)` reads no option: its caller gives the capacity."
        ),
        read_by="host backend, when a host device is opened",
        default_note="half of the machine's (or cgroup's) memory limit",
    ),
    "host_memory": Option(
        "KVCACHED_HOST_MEMORY",
        "shared_files",
        Choice(HOST_MEMORY_KINDS),
        (
            "What the host backend's allocations are. `shared_files`: `memfd` files mapped shared, each 4 "
            "KiB page faulted in by its first use. `anonymous`: private anonymous memory in 4 KiB pages, "
            "allocated when an allocation is created (as `cuMemCreate` does on a GPU) and moved into "
            "place with `mremap`, freed at once on release; running out of memory is a `MemoryError` at "
            "create. `huge_pages`: `anonymous` in 2 MiB transparent huge pages where the kernel allows "
            "them. Whichever kind, a child of `fork()` inherits none of it "
            "([allocator.md](allocator.md#fork)). How the three compare: "
            "[gpu-backends.md](gpu-backends.md)."
        ),
        read_by="host backend, when a host device is opened",
    ),
    "host_populate": Option(
        "KVCACHED_HOST_POPULATE",
        "background",
        Choice(HOST_POPULATE_WAYS),
        (
            "When the pages of `shared_files` allocations get their memory. `background`: when the "
            "mapping thread is bound to some of the CPUs (a CPU engine's worker, as vLLM binds it), as "
            "soon as access is granted, by `madvise(MADV_POPULATE_WRITE)` on one thread per process "
            "running on the other CPUs, so the engine's forward pass does not take a page fault and zero "
            "a page for each 4 KiB it writes first; a range unmapped before its turn is skipped; a "
            "mapping thread free to run on every CPU has none to spare, and its pages fault in on first "
            "write. `on_touch`: always by those faults. Anonymous and huge-page allocations are allocated "
            "at create either way. Unset, an SGLang engine with several ranks or replicas on the CPU "
            "takes `on_touch` (`python/kvcached/integration/common/host_populate.py` says why)."
        ),
        read_by="host backend, when a host device is opened; SGLang integration (scheduler, CPU ranks)",
    ),
    "hip_mapping_settle_us": Option(
        "KVCACHED_HIP_MAPPING_SETTLE_US",
        2000,
        Count(maximum=10_000_000),
        (
            "How old (µs) the newest `hipMemSetAccess` must be before fresh mappings are handed to GPU "
            "work (`fence_new_mappings`); `0` turns the fence off. See `docs/amd.md`."
        ),
        read_by="HIP backend, when a device is opened",
    ),
    "registry_dir": Option(
        "KVCACHED_REGISTRY_DIR",
        "/dev/shm",
        AbsolutePath(),
        (
            "Absolute path of the directory holding the per-device registry files that `kvctl` and "
            "`kvtop` read. Created (mode 0700, or 0770 with a group) when the first engine registers, if "
            "its parent exists. See [security.md](security.md)."
        ),
        read_by="device registry",
    ),
    "registry_group": Option(
        "KVCACHED_REGISTRY_GROUP",
        None,
        GroupName(),
        (
            "A group (name or gid) whose members share the registries: files are made mode 0660 and owned"
            " by it. Every engine and tool sharing a device must set the same value. See "
            "[security.md](security.md)."
        ),
        read_by="device registry",
        default_note="registries are private to their creator",
    ),
    "enable": Option(
        "KVCACHED_ENABLE",
        False,
        Boolean(),
        "Switches kvcached on in a vLLM or SGLang engine; `ENABLE_KVCACHED=true` works too.",
        read_by="vLLM and SGLang integrations",
        aliases=("ENABLE_KVCACHED",),
    ),
    "name": Option(
        "KVCACHED_NAME",
        None,
        InstanceName(),
        (
            "The engine's name in the device registries (one entry per rank) (`kvctl set-limit NAME`, "
            "`kvtop`): 1–63 bytes of UTF-8, no control characters."
        ),
        read_by="vLLM and SGLang integrations",
        default_note="derived from the model",
    ),
    "max_bytes": Option(
        "KVCACHED_LIMIT_BYTES",
        None,
        Size(),
        (
            "The engine's max (its limit, `MemoryPolicy.max_bytes`): most physical KV memory of each rank, "
            "beside the device's shared budget; `kvctl set-policy --max` or `kvctl set-limit` changes it "
            "while the engine runs. See [memory-policy.md](memory-policy.md)."
        ),
        read_by="vLLM and SGLang integrations",
        default_note="vLLM's `kv_cache_memory_bytes` if given, else none",
    ),
    "min_bytes": Option(
        "KVCACHED_MIN_BYTES",
        0,
        Size(),
        (
            "Physical KV memory guaranteed to the engine on each rank: no other instance may take the "
            "device's memory below what it needs to get back to this much. Refused at start when the "
            "instances' mins would sum above the device budget; `kvctl set-policy` changes it while the "
            "engine runs. See [memory-policy.md](memory-policy.md)."
        ),
        read_by="vLLM and SGLang integrations",
    ),
    "priority": Option(
        "KVCACHED_PRIORITY",
        0,
        Integer(minimum=-(2**31), maximum=2**31 - 1),
        (
            "Who gives memory back first when an instance is refused: lower-priority engines are asked to"
            " shrink (idle ones at once, busy ones by dropping cached prefixes, then preempting) down to "
            "their min; higher wins. See [memory-policy.md](memory-policy.md)."
        ),
        read_by="vLLM and SGLang integrations",
    ),
    "idle_cache_bytes": Option(
        "KVCACHED_IDLE_CACHE_BYTES",
        0,
        Size(),
        ("Prefix-cache memory an idle engine keeps; with 0 an engine with no requests returns all of its KV memory."),
        read_by="vLLM and SGLang integrations",
    ),
    "idle_release_s": Option(
        "KVCACHED_IDLE_RELEASE_S",
        5.0,
        Seconds(zero_means="as soon as the engine is idle"),
        (
            "Seconds an idle engine keeps its KV memory before giving it back (down to "
            "`idle_cache_bytes`). This is the first hold: one that ran out before work came back within "
            "`idle_release_max_s` of the spell's start grows to 1.5 times that spell (the spell before "
            "the engine's first work teaches nothing), and a longer spell sets it back to this value. It "
            "gives it back at once when another instance on the same device is refused memory (the "
            "registry's pressure) or when it holds more than its limit (`kvctl set-limit`, `set-budget`), "
            "within about 10 ms. `0`: as soon as the engine is idle. An in-process vLLM EngineCore "
            "(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) holds the same way (the watching thread gives the "
            "memory back); `python/kvcached/integration/common/idle.py`."
        ),
        read_by="vLLM (EngineCore) and SGLang (scheduler) integrations",
    ),
    "idle_release_max_s": Option(
        "KVCACHED_IDLE_RELEASE_MAX_S",
        30.0,
        Seconds(zero_means="a fixed hold of idle_release_s"),
        (
            "The longest a learnt idle hold grows to, so that an engine whose bursts keep coming back "
            "within it keeps its memory between them; at most `idle_release_s`: the hold stays fixed."
        ),
        read_by="vLLM (EngineCore) and SGLang (scheduler) integrations",
    ),
    "keep_freed_while_busy": Option(
        "KVCACHED_KEEP_FREED_WHILE_BUSY",
        True,
        Boolean(),
        (
            "Pages the engine frees (a flushed radix cache, aborted requests) stay mapped for its next "
            "requests, so a burst of allocs after a burst of frees maps no page again; they go back with "
            "the rest of its memory at the end of its idle hold (`idle_release_s`), at once when another "
            "instance on the device waits for memory, or when it holds more than its limit. Off: beyond "
            "`max_reserve_pages` they go back at the end of the step."
        ),
        read_by="SGLang integration (scheduler)",
    ),
    "host_heap_keep_bytes": Option(
        "KVCACHED_HOST_HEAP_KEEP_BYTES",
        256 << 20,
        Size(zero_means="glibc's own behaviour"),
        (
            "Freed heap memory the process that runs the model (SGLang's scheduler, vLLM's CPU worker) "
            "keeps for its next step: glibc's trim threshold is fixed at this size and its mmap threshold "
            "at glibc's own ceiling, 32 MiB (`mallopt`; fixing either stops glibc adjusting both). `0`: "
            "glibc's own behaviour. Not glibc (tcmalloc or jemalloc preloaded, musl): left as it is. The "
            "KV cache is not on this heap and stays elastic. A process that runs the model on the CPU "
            "takes its temporaries from this heap every step, which glibc would otherwise give back and "
            "fault in again (`python/kvcached/integration/common/heap.py`)."
        ),
        read_by="SGLang integration (scheduler) and vLLM integration (each worker), KV cache on the CPU",
    ),
    "wake_timeout_s": Option(
        "KVCACHED_WAKE_TIMEOUT_S",
        10.0,
        Seconds(zero_means="one try"),
        (
            "Seconds an engine's weights, woken from sleep (vLLM's `wake_up`, SGLang's "
            "`resume_memory_occupation`), wait for device memory that other instances give back: each "
            "refused try asks idle and lower-priority instances to give memory back. Then the wake "
            "fails and the weights stay asleep. See [sleep.md](sleep.md)."
        ),
        read_by="vLLM and SGLang integrations (sleep mode, memory saver)",
    ),
    "rank_ack_timeout_s": Option(
        "KVCACHED_RANK_ACK_TIMEOUT_S",
        120.0,
        Seconds(),
        (
            "Seconds after which a rank (tensor-parallel worker or pipeline stage) that has not "
            "acknowledged a page-op batch is declared lost: its budget is given back and its "
            "acknowledgements are no longer awaited. A rank whose process is gone is declared lost at "
            "once."
        ),
        read_by="vLLM integration (EngineCore)",
    ),
}


def get(name: str) -> Optional[object]:
    """Current value of option ``name`` (environment variable, else default)."""
    return OPTIONS[name].get()


__all__ = ["HOST_MEMORY_KINDS", "HOST_POPULATE_WAYS", "LAYOUTS", "OPTIONS", "Option", "get"]
