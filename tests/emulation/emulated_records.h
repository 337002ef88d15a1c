/* EMULATION (test only): the engine's records (reservations, allocations,
 * mappings) and their lock, shared by emulated_vmm.c (the VMM calls) and
 * emulated_device_work.c (copies and fills). */
#ifndef KVCACHED_EMULATED_RECORDS_H
#define KVCACHED_EMULATED_RECORDS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "emulated_vmm.h"

typedef struct {
  uintptr_t base;
  size_t size;
} range_record;
typedef struct {
  uint64_t handle;
  int fd;
  size_t size;
  size_t mapping_count;
  int physical_device;
} allocation_record;
typedef struct {
  uintptr_t address;
  size_t size;
  uint64_t handle;
  int access;                       /* EVMM_ACCESS_* */
  unsigned long long visible_at_ns; /* device work sees it from then on (CLOCK_MONOTONIC) */
} mapping_record;

/* A growable array of records of one type. */
typedef struct {
  void* items;
  size_t count;
  size_t capacity;
} record_array;

extern EVMM_HIDDEN pthread_mutex_t g_lock; /* guards every record */
extern EVMM_HIDDEN record_array g_ranges, g_allocations, g_mappings;

#define RANGES ((range_record*)g_ranges.items)
#define ALLOCATIONS ((allocation_record*)g_allocations.items)
#define MAPPINGS ((mapping_record*)g_mappings.items)

/* Callers hold g_lock. */
EVMM_HIDDEN long evmm_find_range_containing(uintptr_t address, size_t size);
EVMM_HIDDEN unsigned long long evmm_now_ns(void);

#endif
