/* EMULATION (test only, never installed): host-memory engine shared by the fake
 * CUDA driver and fake HIP runtime: the VMM calls. See emulated_vmm.h. One lock
 * guards all records; they are small arrays searched linearly, plenty for tests. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "emulated_config.h"
#include "emulated_records.h"
#include "emulated_vmm.h"

/* What fresh "device memory" holds when KVCACHED_EMULATED_DIRTY_MEMORY=1. */
static const unsigned char kDirtyByte = 0xA5;

pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
record_array g_ranges, g_allocations, g_mappings;
static size_t g_used_bytes[EVMM_MAX_DEVICES];
static uint64_t g_next_handle = 1; /* 0 is never a valid handle */

unsigned long long evmm_now_ns(void) {
  struct timespec now;
  clock_gettime(CLOCK_MONOTONIC, &now);
  return (unsigned long long)now.tv_sec * 1000000000ull + (unsigned long long)now.tv_nsec;
}

static int append_record(record_array* array, const void* record, size_t record_size) {
  if (array->count == array->capacity) {
    size_t grown = array->capacity ? array->capacity * 2 : 64;
    void* items = realloc(array->items, grown * record_size);
    if (!items) return 0;
    array->items = items;
    array->capacity = grown;
  }
  memcpy((char*)array->items + array->count * record_size, record, record_size);
  array->count++;
  return 1;
}

static void remove_record(record_array* array, size_t index, size_t record_size) {
  char* items = (char*)array->items;
  memmove(items + index * record_size, items + (index + 1) * record_size, (array->count - index - 1) * record_size);
  array->count--;
}

void evmm_memory_info(int physical_device, size_t* free_bytes, size_t* total_bytes) {
  pthread_mutex_lock(&g_lock);
  *free_bytes = g_config.capacity_bytes - g_used_bytes[physical_device];
  *total_bytes = g_config.capacity_bytes;
  pthread_mutex_unlock(&g_lock);
}

static int is_aligned(uintptr_t value) { return value % g_config.minimum_granularity_bytes == 0; }

long evmm_find_range_containing(uintptr_t address, size_t size) {
  for (size_t i = 0; i < g_ranges.count; i++) {
    if (address >= RANGES[i].base && address + size <= RANGES[i].base + RANGES[i].size) {
      return (long)i;
    }
  }
  return -1;
}

static long find_allocation(uint64_t handle) {
  for (size_t i = 0; i < g_allocations.count; i++) {
    if (ALLOCATIONS[i].handle == handle) return (long)i;
  }
  return -1;
}

static long find_mapping_at(uintptr_t address) {
  for (size_t i = 0; i < g_mappings.count; i++) {
    if (MAPPINGS[i].address == address) return (long)i;
  }
  return -1;
}

static int overlaps_mapping(uintptr_t address, size_t size) {
  for (size_t i = 0; i < g_mappings.count; i++) {
    if (address < MAPPINGS[i].address + MAPPINGS[i].size && MAPPINGS[i].address < address + size) {
      return 1;
    }
  }
  return 0;
}

/* True when [address, address+size) is exactly a run of whole, adjacent mappings. */
static int is_whole_mappings(uintptr_t address, size_t size) {
  uintptr_t cursor = address;
  while (cursor < address + size) {
    long index = find_mapping_at(cursor);
    if (index < 0) return 0;
    cursor += MAPPINGS[index].size;
  }
  return cursor == address + size;
}

evmm_status evmm_reserve(size_t size_bytes, size_t alignment_bytes, uintptr_t* base) {
  if (!base || size_bytes == 0 || !is_aligned(size_bytes) || !is_aligned(alignment_bytes) ||
      (alignment_bytes & (alignment_bytes - 1)) != 0) {
    evmm_trace("reserve",
               "size and alignment must be multiples of the granularity, "
               "alignment a power of two (or 0)");
    return EVMM_INVALID_VALUE;
  }
  size_t granularity = g_config.minimum_granularity_bytes;
  size_t alignment = alignment_bytes > granularity ? alignment_bytes : granularity;
  /* Over-reserve, then trim to an aligned window: mmap only promises page alignment. */
  size_t padded = size_bytes + alignment;
  void* raw = mmap(NULL, padded, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (raw == MAP_FAILED) return errno == ENOMEM ? EVMM_OUT_OF_MEMORY : EVMM_OS_ERROR;
  uintptr_t start = (uintptr_t)raw;
  uintptr_t aligned = (start + alignment - 1) & ~(uintptr_t)(alignment - 1);
  if (aligned > start) munmap(raw, aligned - start);
  uintptr_t tail = aligned + size_bytes;
  if (start + padded > tail) munmap((void*)tail, start + padded - tail);

  range_record record = {aligned, size_bytes};
  pthread_mutex_lock(&g_lock);
  int appended = append_record(&g_ranges, &record, sizeof record);
  pthread_mutex_unlock(&g_lock);
  if (!appended) {
    munmap((void*)aligned, size_bytes);
    return EVMM_OUT_OF_MEMORY;
  }
  *base = aligned;
  return EVMM_OK;
}

evmm_status evmm_free_range(uintptr_t base, size_t size_bytes) {
  evmm_status status = EVMM_OK;
  pthread_mutex_lock(&g_lock);
  long index = -1;
  for (size_t i = 0; i < g_ranges.count; i++) {
    if (RANGES[i].base == base && RANGES[i].size == size_bytes) index = (long)i;
  }
  if (index < 0) {
    evmm_trace("free_range", "not exactly one reserved range");
    status = EVMM_INVALID_VALUE;
  } else if (overlaps_mapping(base, size_bytes)) {
    evmm_trace("free_range", "the range still has mappings");
    status = EVMM_STILL_MAPPED;
  } else {
    munmap((void*)base, size_bytes);
    remove_record(&g_ranges, (size_t)index, sizeof(range_record));
  }
  pthread_mutex_unlock(&g_lock);
  return status;
}

evmm_status evmm_create(int physical_device, size_t size_bytes, uint64_t* handle) {
  if (!handle || size_bytes == 0 || !is_aligned(size_bytes) || physical_device < 0 ||
      physical_device >= g_config.physical_devices) {
    evmm_trace("create", "size must be a non-zero multiple of the granularity, on a real device");
    return EVMM_INVALID_VALUE;
  }
  evmm_status status = EVMM_OK;
  pthread_mutex_lock(&g_lock);
  if (size_bytes > g_config.capacity_bytes - g_used_bytes[physical_device]) {
    evmm_trace("create", "emulated device memory exhausted (KVCACHED_EMULATED_DEVICE_BYTES)");
    status = EVMM_OUT_OF_MEMORY;
  } else {
    int fd = memfd_create("kvcached-emulated-device-memory", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size_bytes) != 0) {
      if (fd >= 0) close(fd);
      status = EVMM_OS_ERROR;
    } else {
      if (g_config.dirty_memory) {
        /* Device memory is not promised to be zero: make a lost clear visible. */
        void* fresh = mmap(NULL, size_bytes, PROT_WRITE, MAP_SHARED, fd, 0);
        if (fresh != MAP_FAILED) {
          memset(fresh, kDirtyByte, size_bytes);
          munmap(fresh, size_bytes);
        }
      }
      allocation_record record = {g_next_handle, fd, size_bytes, 0, physical_device};
      if (append_record(&g_allocations, &record, sizeof record)) {
        *handle = g_next_handle++;
        g_used_bytes[physical_device] += size_bytes;
      } else {
        close(fd);
        status = EVMM_OUT_OF_MEMORY;
      }
    }
  }
  pthread_mutex_unlock(&g_lock);
  return status;
}

evmm_status evmm_release(uint64_t handle) {
  evmm_status status = EVMM_OK;
  pthread_mutex_lock(&g_lock);
  long index = find_allocation(handle);
  if (index < 0) {
    evmm_trace("release", "unknown allocation handle");
    status = EVMM_UNKNOWN_HANDLE;
  } else if (ALLOCATIONS[index].mapping_count > 0) {
    /* Real CUDA defers the release until the last unmap; refusing is stricter,
     * and kvcached's own bookkeeping never releases a mapped allocation. */
    evmm_trace("release", "the allocation is still mapped");
    status = EVMM_STILL_MAPPED;
  } else {
    close(ALLOCATIONS[index].fd);
    g_used_bytes[ALLOCATIONS[index].physical_device] -= ALLOCATIONS[index].size;
    remove_record(&g_allocations, (size_t)index, sizeof(allocation_record));
  }
  pthread_mutex_unlock(&g_lock);
  return status;
}

evmm_status evmm_map(uintptr_t address, size_t size_bytes, size_t offset_bytes, uint64_t handle) {
  evmm_status status = EVMM_OK;
  pthread_mutex_lock(&g_lock);
  long allocation = find_allocation(handle);
  if (allocation < 0) {
    evmm_trace("map", "unknown allocation handle");
    status = EVMM_UNKNOWN_HANDLE;
  } else if (offset_bytes != 0 || size_bytes != ALLOCATIONS[allocation].size) {
    evmm_trace("map", "only whole allocations map (offset 0, size = allocation size)");
    status = EVMM_NOT_SUPPORTED;
  } else if (!is_aligned(address) || evmm_find_range_containing(address, size_bytes) < 0) {
    evmm_trace("map", "address not aligned or not inside one reserved range");
    status = EVMM_INVALID_VALUE;
  } else if (overlaps_mapping(address, size_bytes)) {
    evmm_trace("map", "the address range is already mapped");
    status = EVMM_ALREADY_MAPPED;
  } else {
    /* Inaccessible until set_access, like a fresh driver mapping. */
    void* mapped = mmap((void*)address, size_bytes, PROT_NONE, MAP_SHARED | MAP_FIXED, ALLOCATIONS[allocation].fd, 0);
    mapping_record record = {address, size_bytes, handle, EVMM_ACCESS_NONE, 0};
    if (mapped == MAP_FAILED) {
      status = EVMM_OS_ERROR;
    } else if (!append_record(&g_mappings, &record, sizeof record)) {
      mmap((void*)address, size_bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
      status = EVMM_OUT_OF_MEMORY;
    } else {
      ALLOCATIONS[allocation].mapping_count++;
    }
  }
  pthread_mutex_unlock(&g_lock);
  return status;
}

evmm_status evmm_unmap(uintptr_t address, size_t size_bytes) {
  evmm_status status = EVMM_OK;
  pthread_mutex_lock(&g_lock);
  if (size_bytes == 0 || !is_whole_mappings(address, size_bytes)) {
    evmm_trace("unmap", "the range is not exactly a run of whole mappings");
    status = EVMM_NOT_MAPPED;
  } else {
    uintptr_t cursor = address;
    while (cursor < address + size_bytes) {
      long index = find_mapping_at(cursor);
      mapping_record mapping = MAPPINGS[index];
      /* Back to a PROT_NONE hole that stays reserved; nothing else can land there. */
      mmap((void*)mapping.address, mapping.size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1,
           0);
      ALLOCATIONS[find_allocation(mapping.handle)].mapping_count--;
      remove_record(&g_mappings, (size_t)index, sizeof(mapping_record));
      cursor += mapping.size;
    }
  }
  pthread_mutex_unlock(&g_lock);
  return status;
}

evmm_status evmm_set_access(uintptr_t address, size_t size_bytes, int access) {
  int protection = PROT_NONE;
  if (access == EVMM_ACCESS_READ) protection = PROT_READ;
  if (access == EVMM_ACCESS_READ_WRITE) protection = PROT_READ | PROT_WRITE;
  evmm_status status = EVMM_OK;
  pthread_mutex_lock(&g_lock);
  if (size_bytes == 0 || !is_whole_mappings(address, size_bytes)) {
    evmm_trace("set_access", "the range is not exactly a run of whole mappings");
    status = EVMM_NOT_MAPPED;
  } else if (mprotect((void*)address, size_bytes, protection) != 0) {
    status = EVMM_OS_ERROR;
  } else {
    /* The moment device work may start to see these mappings. */
    unsigned long long visible_at = evmm_now_ns() + g_config.mapping_delay_ns;
    for (uintptr_t cursor = address; cursor < address + size_bytes;) {
      long index = find_mapping_at(cursor);
      MAPPINGS[index].access = access;
      MAPPINGS[index].visible_at_ns = visible_at;
      cursor += MAPPINGS[index].size;
    }
  }
  pthread_mutex_unlock(&g_lock);
  return status;
}
