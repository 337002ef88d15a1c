/* EMULATION (test only, never installed): device work (copies and fills) over
 * the emulated device memory, with two behaviours reported on ROCm:
 *
 *  - a copy whose device range spans two separately reserved ranges fails
 *    with an invalid-value error, even when the ranges happen to be adjacent
 *    (intel/llvm#22671, on an MI300A);
 *  - a fresh mapping is not yet visible to device work: until its visibility
 *    time (set_access + the face's mapping delay) it reads as zeros and
 *    writes to it are lost, without any error (ROCm/rocm-systems#11693).
 *
 * Device work touching memory without access is an illegal-address error (a
 * GPU page fault), not a host crash. */
#include <stdlib.h>
#include <string.h>

#include "emulated_records.h"
#include "emulated_vmm.h"

int evmm_is_device_address(uintptr_t address) {
  pthread_mutex_lock(&g_lock);
  int inside = evmm_find_range_containing(address, 1) >= 0;
  pthread_mutex_unlock(&g_lock);
  return inside;
}

static long find_mapping_containing(uintptr_t address) {
  for (size_t i = 0; i < g_mappings.count; i++) {
    if (address >= MAPPINGS[i].address && address < MAPPINGS[i].address + MAPPINGS[i].size) {
      return (long)i;
    }
  }
  return -1;
}

/* Checks a device range for device work (caller holds g_lock). */
static evmm_status check_device_range(const char* call, uintptr_t address, size_t size, int needs_write) {
  if (evmm_find_range_containing(address, size) < 0) {
    evmm_trace(call,
               "the device range is not inside one reserved range (ROCm refuses copies "
               "spanning two reservations, even adjacent ones)");
    return EVMM_INVALID_VALUE;
  }
  for (uintptr_t cursor = address; cursor < address + size;) {
    long index = find_mapping_containing(cursor);
    int allowed = needs_write ? EVMM_ACCESS_READ_WRITE : EVMM_ACCESS_READ;
    if (index < 0 || (MAPPINGS[index].access & allowed) != allowed) {
      evmm_trace(call, "device work touches memory that is unmapped or without access");
      return EVMM_ILLEGAL_ADDRESS;
    }
    cursor = MAPPINGS[index].address + MAPPINGS[index].size;
  }
  return EVMM_OK;
}

/* Visits the parts of [address, address + size) whose mapping is (`stale` 1)
 * or is not (`stale` 0) still inside its visibility window (caller holds g_lock). */
typedef void (*part_visitor)(uintptr_t offset, size_t length, void* context);
static void for_each_part(uintptr_t address, size_t size, int stale, part_visitor visit, void* context) {
  const unsigned long long now = evmm_now_ns();
  for (uintptr_t cursor = address; cursor < address + size;) {
    long index = find_mapping_containing(cursor);
    uintptr_t end = MAPPINGS[index].address + MAPPINGS[index].size;
    if (end > address + size) end = address + size;
    if ((now < MAPPINGS[index].visible_at_ns) == stale) visit(cursor - address, end - cursor, context);
    cursor = end;
  }
}

/* A stale source part reads as zeros. */
static void zero_part(uintptr_t offset, size_t length, void* destination) {
  memset((char*)destination + offset, 0, length);
}

/* Only visible destination parts take the write; the rest is lost. */
typedef struct {
  char* destination;
  const char* source;
  int fill_value;
} write_job;
static void copy_part(uintptr_t offset, size_t length, void* context) {
  write_job* job = (write_job*)context;
  memcpy(job->destination + offset, job->source + offset, length);
}
static void fill_part(uintptr_t offset, size_t length, void* context) {
  write_job* job = (write_job*)context;
  memset(job->destination + offset, job->fill_value, length);
}

evmm_status evmm_device_copy(uintptr_t destination, uintptr_t source, size_t size_bytes, int destination_on_device,
                             int source_on_device) {
  if (size_bytes == 0) return EVMM_OK;
  /* Device to device goes through a host copy so a stale source reads as zeros. */
  char* staged = destination_on_device && source_on_device ? malloc(size_bytes) : NULL;
  if (destination_on_device && source_on_device && !staged) return EVMM_OUT_OF_MEMORY;
  evmm_status status = EVMM_OK;
  pthread_mutex_lock(&g_lock);
  if (source_on_device) status = check_device_range("copy (source)", source, size_bytes, 0);
  if (status == EVMM_OK && destination_on_device) {
    status = check_device_range("copy (destination)", destination, size_bytes, 1);
  }
  if (status == EVMM_OK && !destination_on_device) {
    memcpy((void*)destination, (const void*)source, size_bytes);
    if (source_on_device) for_each_part(source, size_bytes, 1, zero_part, (void*)destination);
  } else if (status == EVMM_OK) {
    const char* from = (const char*)source;
    if (staged) {
      memcpy(staged, from, size_bytes);
      for_each_part(source, size_bytes, 1, zero_part, staged);
      from = staged;
    }
    write_job job = {(char*)destination, from, 0};
    for_each_part(destination, size_bytes, 0, copy_part, &job);
  }
  pthread_mutex_unlock(&g_lock);
  free(staged);
  return status;
}

evmm_status evmm_device_fill(uintptr_t destination, int value, size_t size_bytes) {
  if (size_bytes == 0) return EVMM_OK;
  pthread_mutex_lock(&g_lock);
  evmm_status status = check_device_range("fill", destination, size_bytes, 1);
  if (status == EVMM_OK) {
    write_job job = {(char*)destination, NULL, value};
    for_each_part(destination, size_bytes, 0, fill_part, &job);
  }
  pthread_mutex_unlock(&g_lock);
  return status;
}
