// Background population of freshly mapped host pages.
//
// A memfd page is allocated and zeroed by the kernel on its first write: one
// fault per 4 KiB, taken by whoever writes first. In an engine that is the
// forward pass (vLLM's CPU worker: 0.44 ms of kernel time per 13.5 ms step
// with kvcached's memory moving between bursts, bench/RESULTS.md). Populating a range as soon as it becomes
// accessible, on a thread of its own that stays off the CPUs the mapping
// thread is bound to, takes that work off the engine's critical path. A
// mapping thread that may run on every CPU gets nothing queued: there is no
// spare CPU to hand the work to, and a populating thread would compete with
// the engine's compute threads.
//
// Population is advisory: a range unmapped (or remapped) before its turn
// fails or populates whatever kvcached mapped there since, and errors are
// ignored; the kernel serialises it with munmap/mmap. Memory is not
// over-counted: only what a budget already counts as mapped is populated.
#pragma once

#include <cstddef>

#include "kvcached/backends/host_backend.hpp"

namespace kvcached {

// Queues [address, address + size_bytes) for MADV_POPULATE_WRITE on this
// process's populating thread (started on first use, again in a forked
// child) if the calling thread is bound to some of the online CPUs; the
// populating thread runs on the others. Never throws: pages not populated
// fault in on first write.
void populate_in_background(VirtualAddress address, std::size_t size_bytes) noexcept;

// wait_for_population() (kvcached/backends/host_backend.hpp) blocks until every
// range queued so far has been populated.

}  // namespace kvcached
