// FaultGuard: a registry file that shrinks under a MAP_SHARED mapping must not kill the process.
//
// Rationale. Accessing a MAP_SHARED page past the end of its file raises SIGBUS,
// which kills the process: one `truncate` of the registry (by a careless
// operator, or any process allowed to write it) would take down every engine on
// the device. The alternatives do not hold: checking the size (fstat) before
// each access leaves a window between the check and the access; seals
// (F_SEAL_SHRINK) exist only for memfd files, which cannot be published under a
// path that unrelated processes open; a private copy would not be shared.
//
// Approach. The registry's accesses to its mapping are plain loads, stores and
// atomics in user space (the lock never sleeps in the kernel on the mapping:
// see registry_lock.hpp), so a shrink shows up only as SIGBUS at a registry
// address. A process-wide SIGBUS handler, installed once when the first registry
// is mapped, looks the faulting address up in a fixed table of watched
// mappings. If it is one, it maps private zero pages over the whole mapping
// (MAP_FIXED), marks that registry detached and returns, so the faulting
// instruction completes on harmless memory; the registry then refuses every
// later call with a clear error. Any other SIGBUS goes to the handler that was
// installed before (or the default action), exactly as without kvcached.
//
// Limitations. A SIGBUS handler installed later by someone else, without
// chaining to ours, takes this protection away. A detached mapping is never
// unmapped (a thread's robust-mutex list may still point into it), so each
// costs its size of memory until the process exits.
#pragma once

#include <atomic>
#include <cstddef>

namespace kvcached::registry_detail {

// Watches [address, address + length): a SIGBUS inside it replaces the range
// with private zero pages and stores `reason` into `*detached` (if still 0).
// Returns a token for unwatch_mapping. Installs the handler on first use.
int watch_mapping(void* address, std::size_t length, std::atomic<int>* detached, int reason);
void unwatch_mapping(int token) noexcept;

// Replaces [address, address + length) with private zero pages now; false on failure.
bool replace_with_private_pages(void* address, std::size_t length) noexcept;

}  // namespace kvcached::registry_detail
