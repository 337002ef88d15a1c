/* EMULATION (test only): the configuration record the engine's files share
 * (filled once by emulated_config.c; read-only afterwards). */
#ifndef KVCACHED_EMULATED_CONFIG_H
#define KVCACHED_EMULATED_CONFIG_H

#include <stddef.h>

#include "emulated_vmm.h"

typedef struct evmm_config {
  int physical_devices;
  size_t capacity_bytes; /* per device */
  size_t minimum_granularity_bytes;
  size_t recommended_granularity_bytes;
  int vmm_supported;
  unsigned long long mapping_delay_ns; /* fresh mappings invisible to device work this long */
  int dirty_memory;                    /* fresh allocations hold garbage, not zeros */
  int trace;
} evmm_config;

extern EVMM_HIDDEN evmm_config g_config;

#endif
