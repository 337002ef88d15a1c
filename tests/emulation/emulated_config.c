/* EMULATION (test only, never installed): the emulated machine's configuration
 * (environment variables, read once), its devices' UUIDs, and the parser of
 * visible-devices lists shared by the fake CUDA driver and fake HIP runtime. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "emulated_config.h"
#include "emulated_vmm.h"

static const size_t kDefaultCapacityBytes = (size_t)8 << 30; /* 8 GiB, a small GPU */

static pthread_once_t g_once = PTHREAD_ONCE_INIT;
static const evmm_face* g_face;
evmm_config g_config;

/* A misconfigured emulation must not let tests pass vacuously: stop loudly. */
static void refuse(const char* variable, const char* value, const char* expected) {
  fprintf(stderr, "[kvcached emulation] %s=%s is not valid: expected %s\n", variable, value, expected);
  abort();
}

/* Unsigned integer from the environment; `fallback` when unset or empty. */
static unsigned long long env_number(const char* variable, unsigned long long fallback) {
  const char* text = getenv(variable);
  if (!text || !*text) return fallback;
  char* end = NULL;
  unsigned long long value = strtoull(text, &end, 10);
  if (!end || *end != '\0' || text[0] == '-') refuse(variable, text, "a non-negative integer");
  return value;
}

static int is_power_of_two(size_t value) { return value != 0 && (value & (value - 1)) == 0; }

/* KVCACHED_EMULATED_GRANULARITY: "MIN/RECOMMENDED" or "MIN" (both then MIN), in bytes. */
static void read_granularity(void) {
  g_config.minimum_granularity_bytes = g_face->default_minimum_granularity_bytes;
  g_config.recommended_granularity_bytes = g_face->default_recommended_granularity_bytes;
  const char* text = getenv("KVCACHED_EMULATED_GRANULARITY");
  if (!text || !*text) return;
  char* end = NULL;
  unsigned long long minimum = strtoull(text, &end, 10);
  unsigned long long recommended = minimum;
  if (end && *end == '/') recommended = strtoull(end + 1, &end, 10);
  if (!end || *end != '\0' || !is_power_of_two(minimum) || !is_power_of_two(recommended) || recommended < minimum ||
      minimum < 4096) {
    refuse("KVCACHED_EMULATED_GRANULARITY", text,
           "MIN or MIN/RECOMMENDED in bytes, powers of two, 4096 <= MIN <= RECOMMENDED");
  }
  g_config.minimum_granularity_bytes = (size_t)minimum;
  g_config.recommended_granularity_bytes = (size_t)recommended;
}

static void read_config(void) {
  unsigned long long devices = env_number("KVCACHED_EMULATED_GPUS", 1);
  if (devices < 1 || devices > EVMM_MAX_DEVICES) {
    refuse("KVCACHED_EMULATED_GPUS", getenv("KVCACHED_EMULATED_GPUS"), "1 to 16");
  }
  g_config.physical_devices = (int)devices;
  g_config.capacity_bytes = (size_t)env_number("KVCACHED_EMULATED_DEVICE_BYTES", kDefaultCapacityBytes);
  read_granularity();
  unsigned long long vmm = env_number("KVCACHED_EMULATED_VMM", 1);
  if (vmm > 1) refuse("KVCACHED_EMULATED_VMM", getenv("KVCACHED_EMULATED_VMM"), "0 or 1");
  g_config.vmm_supported = (int)vmm;
  g_config.mapping_delay_ns = g_face->mapping_delay_env ? env_number(g_face->mapping_delay_env, 0) * 1000ull : 0;
  g_config.dirty_memory = env_number("KVCACHED_EMULATED_DIRTY_MEMORY", 0) != 0;
  const char* trace = getenv("KVCACHED_EMULATION_TRACE");
  g_config.trace = trace && strcmp(trace, "1") == 0;
}

void evmm_init(const evmm_face* face) {
  if (!g_face) g_face = face; /* one face per library */
  pthread_once(&g_once, read_config);
}

int evmm_physical_devices(void) { return g_config.physical_devices; }
size_t evmm_minimum_granularity(void) { return g_config.minimum_granularity_bytes; }
size_t evmm_recommended_granularity(void) { return g_config.recommended_granularity_bytes; }
int evmm_vmm_supported(void) { return g_config.vmm_supported; }
size_t evmm_capacity_bytes(void) { return g_config.capacity_bytes; }

void evmm_trace(const char* call, const char* why) {
  if (g_config.trace) fprintf(stderr, "[kvcached emulation] %s refused: %s\n", call, why);
}

void evmm_uuid(int physical_device, unsigned char out[EVMM_UUID_BYTES]) {
  /* A fixed pseudo-random sequence per device (64-bit LCG), so UUIDs look real
   * and differ in their first characters, which visible-devices prefixes use. */
  unsigned long long state = 0x6b7663616368ull + 0x9E3779B97F4A7C15ull * (unsigned)(physical_device + 1);
  for (int i = 0; i < EVMM_UUID_BYTES; i++) {
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    out[i] = (unsigned char)(state >> 56);
  }
}

int evmm_visible_devices(const char* list, int candidate_count,
                         void (*uuid_text)(int candidate, char* text, size_t size), int out[EVMM_MAX_DEVICES]) {
  int count = 0;
  if (!list) {
    for (int i = 0; i < candidate_count && i < EVMM_MAX_DEVICES; i++) out[count++] = i;
    return count;
  }
  char entries[256];
  snprintf(entries, sizeof entries, "%s", list);
  char* saved = NULL;
  for (char* entry = strtok_r(entries, ",", &saved); entry && count < EVMM_MAX_DEVICES;
       entry = strtok_r(NULL, ",", &saved)) {
    while (*entry == ' ') entry++;
    int found = -1;
    if (strncmp(entry, "GPU-", 4) == 0) {
      for (int i = 0; i < candidate_count; i++) {
        char text[64];
        uuid_text(i, text, sizeof text);
        if (strncasecmp(text, entry, strlen(entry)) == 0) {
          found = i;
          break;
        }
      }
    } else {
      char* end = NULL;
      long index = strtol(entry, &end, 10);
      if (end != entry && *end == '\0' && index >= 0 && index < candidate_count) found = (int)index;
    }
    for (int i = 0; i < count; i++) {
      if (out[i] == found) found = -1; /* a repeat ends the list too */
    }
    if (found < 0) break;
    out[count++] = found;
  }
  return count;
}
