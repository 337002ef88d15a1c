/* EMULATION (test only, never installed): the virtual-memory engine behind the
 * fake CUDA driver and fake HIP runtime in this folder.
 *
 * Emulates a device's VMM API over host memory: a reservation is a PROT_NONE
 * anonymous mapping, a physical allocation is a memfd, mapping is
 * mmap(MAP_SHARED | MAP_FIXED) of the memfd into the reservation. It enforces
 * the rules the real drivers enforce (and a few stricter ones, listed in
 * README.md) so that backend code that breaks them fails here too. */
#ifndef KVCACHED_EMULATED_VMM_H
#define KVCACHED_EMULATED_VMM_H

#include <stddef.h>
#include <stdint.h>

#define EVMM_HIDDEN __attribute__((visibility("hidden")))

typedef enum evmm_status {
  EVMM_OK = 0,
  EVMM_INVALID_VALUE,   /* bad size, alignment, address or argument */
  EVMM_OUT_OF_MEMORY,   /* the emulated capacity is used up */
  EVMM_NOT_SUPPORTED,   /* non-zero offset or partial mapping of an allocation */
  EVMM_ALREADY_MAPPED,  /* mapping over an address that is already mapped */
  EVMM_NOT_MAPPED,      /* unmap / set access of a range that is not whole mappings */
  EVMM_STILL_MAPPED,    /* release or free of something that is still mapped */
  EVMM_UNKNOWN_HANDLE,  /* no such allocation */
  EVMM_OS_ERROR         /* mmap / memfd_create failed */
} evmm_status;

/* Access flags for evmm_set_access. */
enum { EVMM_ACCESS_NONE = 0, EVMM_ACCESS_READ = 1, EVMM_ACCESS_READ_WRITE = 3 };

/* Sets the minimum granularity (size and alignment unit) once per library;
 * the capacity comes from KVCACHED_EMULATED_DEVICE_BYTES (default 8 GiB). */
EVMM_HIDDEN void evmm_init(size_t minimum_granularity_bytes);
EVMM_HIDDEN size_t evmm_capacity_bytes(void);
EVMM_HIDDEN void evmm_memory_info(size_t* free_bytes, size_t* total_bytes);

EVMM_HIDDEN evmm_status evmm_reserve(size_t size_bytes, size_t alignment_bytes, uintptr_t* base);
EVMM_HIDDEN evmm_status evmm_free_range(uintptr_t base, size_t size_bytes);
EVMM_HIDDEN evmm_status evmm_create(size_t size_bytes, uint64_t* handle);
EVMM_HIDDEN evmm_status evmm_release(uint64_t handle);
EVMM_HIDDEN evmm_status evmm_map(uintptr_t address, size_t size_bytes, size_t offset_bytes,
                                 uint64_t handle);
EVMM_HIDDEN evmm_status evmm_unmap(uintptr_t address, size_t size_bytes);
EVMM_HIDDEN evmm_status evmm_set_access(uintptr_t address, size_t size_bytes, int access);

/* With KVCACHED_EMULATION_TRACE=1, rule violations are explained on stderr. */
EVMM_HIDDEN void evmm_trace(const char* call, const char* why);

#endif
