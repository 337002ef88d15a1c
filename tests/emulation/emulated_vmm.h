/* EMULATION (test only, never installed): the virtual-memory engine behind the
 * fake CUDA driver and fake HIP runtime in this folder.
 *
 * Emulates a machine's GPUs and their VMM API over host memory: a reservation
 * is a PROT_NONE anonymous mapping, a physical allocation is a memfd, mapping
 * is mmap(MAP_SHARED | MAP_FIXED) of the memfd into the reservation. It
 * enforces the rules the real drivers enforce (and a few stricter ones, listed
 * in README.md) so that backend code that breaks them fails here too, and
 * models device work (copies, fills) with the ROCm behaviours of README.md.
 * Configured by environment variables read once, at the first call. */
#ifndef KVCACHED_EMULATED_VMM_H
#define KVCACHED_EMULATED_VMM_H

#include <stddef.h>
#include <stdint.h>

#define EVMM_HIDDEN __attribute__((visibility("hidden")))
#define EVMM_MAX_DEVICES 16
#define EVMM_UUID_BYTES 16

typedef enum evmm_status {
  EVMM_OK = 0,
  EVMM_INVALID_VALUE,   /* bad size, alignment, address or argument */
  EVMM_OUT_OF_MEMORY,   /* the emulated capacity is used up */
  EVMM_NOT_SUPPORTED,   /* non-zero offset or partial mapping; VMM switched off */
  EVMM_ALREADY_MAPPED,  /* mapping over an address that is already mapped */
  EVMM_NOT_MAPPED,      /* unmap / set access of a range that is not whole mappings */
  EVMM_STILL_MAPPED,    /* release or free of something that is still mapped */
  EVMM_UNKNOWN_HANDLE,  /* no such allocation */
  EVMM_ILLEGAL_ADDRESS, /* device work touching memory it has no access to */
  EVMM_OS_ERROR         /* mmap / memfd_create failed */
} evmm_status;

/* Access flags for evmm_set_access. */
enum { EVMM_ACCESS_NONE = 0, EVMM_ACCESS_READ = 1, EVMM_ACCESS_READ_WRITE = 3 };

/* What a fake driver library brings to the engine's configuration. */
typedef struct evmm_face {
  size_t default_minimum_granularity_bytes;
  size_t default_recommended_granularity_bytes;
  /* Environment variable giving how long a fresh mapping stays invisible to
   * device work, in microseconds; NULL when the face has no such window. */
  const char* mapping_delay_env;
} evmm_face;

/* Reads the configuration once per library (README.md lists the variables). */
EVMM_HIDDEN void evmm_init(const evmm_face* face);
EVMM_HIDDEN int evmm_physical_devices(void);
EVMM_HIDDEN size_t evmm_minimum_granularity(void);
EVMM_HIDDEN size_t evmm_recommended_granularity(void);
EVMM_HIDDEN int evmm_vmm_supported(void);
EVMM_HIDDEN size_t evmm_capacity_bytes(void);
EVMM_HIDDEN void evmm_memory_info(int physical_device, size_t* free_bytes, size_t* total_bytes);
/* A fixed, distinct 16-byte UUID per physical device. */
EVMM_HIDDEN void evmm_uuid(int physical_device, unsigned char out[EVMM_UUID_BYTES]);

/* Resolves a visible-devices list ("1,0", "GPU-…", as CUDA_VISIBLE_DEVICES and
 * ROCm's variables take) against `candidate_count` candidates; `uuid_text`
 * writes a candidate's UUID text ("GPU-…") into a buffer. Entries are indices
 * into the candidates or UUID prefixes; the list ends at the first entry that
 * names no candidate or repeats one. NULL `list`: every candidate, in order.
 * Returns how many were written to `out` (indices into the candidates). */
EVMM_HIDDEN int evmm_visible_devices(const char* list, int candidate_count,
                                     void (*uuid_text)(int candidate, char* text, size_t size),
                                     int out[EVMM_MAX_DEVICES]);

EVMM_HIDDEN evmm_status evmm_reserve(size_t size_bytes, size_t alignment_bytes, uintptr_t* base);
EVMM_HIDDEN evmm_status evmm_free_range(uintptr_t base, size_t size_bytes);
EVMM_HIDDEN evmm_status evmm_create(int physical_device, size_t size_bytes, uint64_t* handle);
EVMM_HIDDEN evmm_status evmm_release(uint64_t handle);
EVMM_HIDDEN evmm_status evmm_map(uintptr_t address, size_t size_bytes, size_t offset_bytes, uint64_t handle);
EVMM_HIDDEN evmm_status evmm_unmap(uintptr_t address, size_t size_bytes);
EVMM_HIDDEN evmm_status evmm_set_access(uintptr_t address, size_t size_bytes, int access);

/* Device work. Device ranges must lie inside one reservation (ROCm fails a
 * copy spanning two, even adjacent ones) and be mapped with access; parts of a
 * mapping still inside its visibility window read as zeros and drop writes. */
EVMM_HIDDEN int evmm_is_device_address(uintptr_t address);
EVMM_HIDDEN evmm_status evmm_device_copy(uintptr_t destination, uintptr_t source, size_t size_bytes,
                                         int destination_on_device, int source_on_device);
EVMM_HIDDEN evmm_status evmm_device_fill(uintptr_t destination, int value, size_t size_bytes);

/* With KVCACHED_EMULATION_TRACE=1, rule violations are explained on stderr. */
EVMM_HIDDEN void evmm_trace(const char* call, const char* why);

#endif
