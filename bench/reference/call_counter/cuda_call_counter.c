/* cuda_call_counter: an LD_PRELOAD shim that records every CUDA driver VMM call a
 * process makes (which call, how many bytes, how many mappings it spans, how long
 * the driver took) and whether it touched a *zero* allocation, then forwards the
 * call to the real driver (or to the test-only emulation) unchanged.
 *
 *   cc -O2 -shared -fPIC -o libcuda_call_counter.so cuda_call_counter.c -ldl -lpthread
 *   LD_PRELOAD=$PWD/libcuda_call_counter.so python ...   (bench/reference/driver_calls.py builds and reads it)
 *
 * A physical allocation counts as a zero allocation once it is zero-filled while
 * mapped (cuMemsetD8) or mapped at two addresses at once (one shared zero page
 * mapped over many holes); the few calls made on it before that are re-labelled.
 * The shim declares the handful of driver types it needs, so it builds without
 * cuda.h. It never changes a call's arguments or result.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemHandle;
typedef struct CUctx_st* CUcontext;
enum { kSuccess = 0 };

/* Call kinds, in the order bench/reference/driver_calls.py names them. */
enum {
  kReserve,
  kFreeRange,
  kCreate,
  kRelease,
  kMap,
  kUnmap,
  kSetAccess,
  kMemset,
  kSynchronize,
  kMemGetInfo,
  kCtxGetCurrent,
  kCtxSetCurrent,
  kCallKinds
};

struct ccount_event {
  uint32_t call;      /* one of the kinds above */
  uint32_t zero;      /* 1 when it touched a zero allocation */
  uint64_t bytes;     /* size argument (0 where the call has none) */
  uint64_t mappings;  /* mappings a range call (unmap, set_access) spans */
  uint64_t handle;    /* allocation concerned (first mapping's, for range calls) */
  uint64_t driver_ns; /* time inside the real driver call */
};

/* ---- tables: open addressing with linear probing, keys never 0 ----------------- */

struct slot {
  uint64_t key;
  uint64_t a, b; /* mappings: size, handle; handles: live mappings, zero flag */
};

struct table {
  struct slot* slots;
  size_t capacity; /* power of two */
  size_t used;
};

static size_t slot_of(const struct table* t, uint64_t key) {
  return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & (t->capacity - 1);
}

static struct slot* table_find(struct table* t, uint64_t key) {
  if (t->capacity == 0) return NULL;
  for (size_t i = slot_of(t, key);; i = (i + 1) & (t->capacity - 1)) {
    if (t->slots[i].key == key) return &t->slots[i];
    if (t->slots[i].key == 0) return NULL;
  }
}

static void table_put(struct table* t, uint64_t key, uint64_t a, uint64_t b);

static void table_grow(struct table* t) {
  struct table bigger = {calloc(t->capacity ? t->capacity * 2 : 1024, sizeof(struct slot)),
                         t->capacity ? t->capacity * 2 : 1024, 0};
  if (bigger.slots == NULL) abort(); /* a benchmark shim: no way to go on without memory */
  for (size_t i = 0; i < t->capacity; ++i) {
    if (t->slots[i].key != 0) table_put(&bigger, t->slots[i].key, t->slots[i].a, t->slots[i].b);
  }
  free(t->slots);
  *t = bigger;
}

static void table_put(struct table* t, uint64_t key, uint64_t a, uint64_t b) {
  struct slot* found = table_find(t, key);
  if (found != NULL) {
    found->a = a;
    found->b = b;
    return;
  }
  if ((t->used + 1) * 2 > t->capacity) table_grow(t);
  size_t i = slot_of(t, key);
  while (t->slots[i].key != 0) i = (i + 1) & (t->capacity - 1);
  t->slots[i] = (struct slot){key, a, b};
  ++t->used;
}

/* Backward-shift deletion keeps probe chains intact without tombstones. */
static void table_erase(struct table* t, uint64_t key) {
  if (t->capacity == 0) return;
  size_t i = slot_of(t, key);
  while (t->slots[i].key != key) {
    if (t->slots[i].key == 0) return;
    i = (i + 1) & (t->capacity - 1);
  }
  for (size_t j = (i + 1) & (t->capacity - 1); t->slots[j].key != 0; j = (j + 1) & (t->capacity - 1)) {
    const size_t home = slot_of(t, t->slots[j].key);
    /* Move j into the hole at i unless its home lies cyclically in (i, j]. */
    const int stays = (i <= j) ? (i < home && home <= j) : (i < home || home <= j);
    if (!stays) {
      t->slots[i] = t->slots[j];
      i = j;
    }
  }
  t->slots[i].key = 0;
  --t->used;
}

/* ---- state ------------------------------------------------------------------ */

static pthread_mutex_t g_mutex = PTHREAD_MUTEX_INITIALIZER;
static struct table g_mappings; /* address -> (size, handle) */
static struct table g_handles;  /* handle -> (live mappings, zero flag) */
static struct ccount_event* g_events;
static size_t g_event_count, g_event_capacity;
enum { kRelabelWindow = 256 }; /* events searched back when an allocation turns out to be zero */

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int handle_is_zero(uint64_t handle) {
  const struct slot* h = table_find(&g_handles, handle);
  return h != NULL && h->b != 0;
}

static void mark_zero(uint64_t handle) {
  struct slot* h = table_find(&g_handles, handle);
  if (h == NULL || h->b != 0) return;
  h->b = 1;
  const size_t stop = g_event_count > kRelabelWindow ? g_event_count - kRelabelWindow : 0;
  for (size_t i = g_event_count; i-- > stop;) {
    if (g_events[i].handle == handle) g_events[i].zero = 1;
  }
}

static void record(uint32_t call, uint64_t bytes, uint64_t mappings, uint64_t handle, uint64_t ns) {
  if (g_event_count == g_event_capacity) {
    const size_t capacity = g_event_capacity ? g_event_capacity * 2 : 4096;
    struct ccount_event* grown = realloc(g_events, capacity * sizeof(*grown));
    if (grown == NULL) abort();
    g_events = grown;
    g_event_capacity = capacity;
  }
  g_events[g_event_count++] =
      (struct ccount_event){call, (uint32_t)(handle != 0 && handle_is_zero(handle)), bytes, mappings, handle, ns};
}

/* The mappings exactly covering [address, address + size): count, first handle. */
static uint64_t walk_range(CUdeviceptr address, size_t size, uint64_t* first_handle, int erase) {
  uint64_t count = 0;
  *first_handle = 0;
  for (CUdeviceptr cursor = address; cursor < address + size;) {
    struct slot* m = table_find(&g_mappings, cursor);
    if (m == NULL) break; /* not a run of whole mappings: the driver will have refused it */
    const uint64_t mapped_bytes = m->a, handle = m->b;
    if (count == 0) *first_handle = handle;
    ++count;
    if (erase) {
      struct slot* h = table_find(&g_handles, handle);
      if (h != NULL && h->a > 0) --h->a;
      table_erase(&g_mappings, cursor);
    }
    cursor += mapped_bytes;
  }
  return count;
}

/* ---- forwarding ------------------------------------------------------------- */

/* The driver's definition of `symbol`. Modules that Python or torch load with
 * RTLD_LOCAL bring libcuda into their own scope, out of RTLD_NEXT's reach, so the
 * driver library is also asked directly. */
static void* driver_symbol(const char* symbol) {
  void* found = dlsym(RTLD_NEXT, symbol);
  if (found != NULL) return found;
  void* driver = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);
  if (driver == NULL) driver = dlopen("libcuda.so.1", RTLD_LAZY);
  return driver != NULL ? dlsym(driver, symbol) : NULL;
}

/* Looked up once per call kind; the shim's own definition gives the pointer type. */
#define REAL(name)                                                                \
  static __typeof__(&name) real_##name;                                           \
  if (real_##name == NULL) real_##name = (__typeof__(&name))driver_symbol(#name); \
  if (real_##name == NULL) return 999 /* CUDA_ERROR_UNKNOWN */

typedef struct CUmemAllocationProp_st CUmemAllocationProp;
typedef struct CUmemAccessDesc_st CUmemAccessDesc;

CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
  REAL(cuMemAddressReserve);
  const uint64_t start = now_ns();
  const CUresult result = real_cuMemAddressReserve(ptr, size, alignment, addr, flags);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  if (result == kSuccess) record(kReserve, size, 0, 0, ns);
  pthread_mutex_unlock(&g_mutex);
  return result;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
  REAL(cuMemAddressFree);
  const uint64_t start = now_ns();
  const CUresult result = real_cuMemAddressFree(ptr, size);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  if (result == kSuccess) record(kFreeRange, size, 0, 0, ns);
  pthread_mutex_unlock(&g_mutex);
  return result;
}

CUresult cuMemCreate(CUmemHandle* handle, size_t size, const CUmemAllocationProp* prop, unsigned long long flags) {
  REAL(cuMemCreate);
  const uint64_t start = now_ns();
  const CUresult result = real_cuMemCreate(handle, size, prop, flags);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  if (result == kSuccess) {
    table_put(&g_handles, *handle, 0, 0);
    record(kCreate, size, 0, *handle, ns);
  }
  pthread_mutex_unlock(&g_mutex);
  return result;
}

CUresult cuMemRelease(CUmemHandle handle) {
  REAL(cuMemRelease);
  const uint64_t start = now_ns();
  const CUresult result = real_cuMemRelease(handle);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  if (result == kSuccess) {
    record(kRelease, 0, 0, handle, ns);
    /* Real CUDA frees on the last unmap; keep the entry while mappings live. */
    const struct slot* h = table_find(&g_handles, handle);
    if (h != NULL && h->a == 0) table_erase(&g_handles, handle);
  }
  pthread_mutex_unlock(&g_mutex);
  return result;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemHandle handle, unsigned long long flags) {
  REAL(cuMemMap);
  const uint64_t start = now_ns();
  const CUresult result = real_cuMemMap(ptr, size, offset, handle, flags);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  if (result == kSuccess) {
    struct slot* h = table_find(&g_handles, handle);
    if (h == NULL) { /* created before the shim saw it (cannot happen when preloaded) */
      table_put(&g_handles, handle, 0, 0);
      h = table_find(&g_handles, handle);
    }
    h->a += 1;
    const int shared = h->a >= 2;
    table_put(&g_mappings, ptr, size, handle);
    record(kMap, size, 1, handle, ns);
    if (shared) mark_zero(handle);
  }
  pthread_mutex_unlock(&g_mutex);
  return result;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
  REAL(cuMemUnmap);
  const uint64_t start = now_ns();
  const CUresult result = real_cuMemUnmap(ptr, size);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  if (result == kSuccess) {
    /* Label before erasing, so the handle's zero flag is still known. */
    uint64_t first = 0;
    const uint64_t spans = walk_range(ptr, size, &first, 0);
    record(kUnmap, size, spans, first, ns);
    walk_range(ptr, size, &first, 1);
  }
  pthread_mutex_unlock(&g_mutex);
  return result;
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc* desc, size_t count) {
  REAL(cuMemSetAccess);
  const uint64_t start = now_ns();
  const CUresult result = real_cuMemSetAccess(ptr, size, desc, count);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  if (result == kSuccess) {
    uint64_t first = 0;
    const uint64_t spans = walk_range(ptr, size, &first, 0);
    record(kSetAccess, size, spans, first, ns);
  }
  pthread_mutex_unlock(&g_mutex);
  return result;
}

/* The mapping holding `address` (not necessarily at its start), or 0. */
static uint64_t handle_at(CUdeviceptr address) {
  for (size_t i = 0; i < g_mappings.capacity; ++i) {
    const struct slot* m = &g_mappings.slots[i];
    if (m->key != 0 && m->key <= address && address < m->key + m->a) return m->b;
  }
  return 0;
}

CUresult cuMemsetD8_v2(CUdeviceptr ptr, unsigned char value, size_t count) {
  REAL(cuMemsetD8_v2);
  const uint64_t start = now_ns();
  const CUresult result = real_cuMemsetD8_v2(ptr, value, count);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  if (result == kSuccess) {
    const struct slot* m = table_find(&g_mappings, ptr); /* the usual case: a whole allocation */
    const uint64_t handle = m != NULL ? m->b : handle_at(ptr);
    if (value == 0 && handle != 0) mark_zero(handle);
    record(kMemset, count, 0, handle, ns);
  }
  pthread_mutex_unlock(&g_mutex);
  return result;
}

CUresult cuCtxSynchronize(void) {
  REAL(cuCtxSynchronize);
  const uint64_t start = now_ns();
  const CUresult result = real_cuCtxSynchronize();
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  record(kSynchronize, 0, 0, 0, ns);
  pthread_mutex_unlock(&g_mutex);
  return result;
}

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
  REAL(cuMemGetInfo_v2);
  const uint64_t start = now_ns();
  const CUresult result = real_cuMemGetInfo_v2(free_bytes, total_bytes);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  record(kMemGetInfo, 0, 0, 0, ns);
  pthread_mutex_unlock(&g_mutex);
  return result;
}

/* ---- read-back (ctypes) ------------------------------------------------------ */

size_t ccount_event_count(void) {
  pthread_mutex_lock(&g_mutex);
  const size_t count = g_event_count;
  pthread_mutex_unlock(&g_mutex);
  return count;
}

/* Copies events [first, first + max) into `out`; returns how many were copied. */
size_t ccount_copy_events(size_t first, size_t max, struct ccount_event* out) {
  pthread_mutex_lock(&g_mutex);
  size_t copied = 0;
  if (first < g_event_count) {
    copied = g_event_count - first < max ? g_event_count - first : max;
    memcpy(out, g_events + first, copied * sizeof(*out));
  }
  pthread_mutex_unlock(&g_mutex);
  return copied;
}

size_t ccount_event_size(void) { return sizeof(struct ccount_event); }

/* Context calls: a backend that switches the calling thread's context around
 * every call pays for it on each one; counted so that cost shows. */
CUresult cuCtxGetCurrent(CUcontext* context) {
  REAL(cuCtxGetCurrent);
  const uint64_t start = now_ns();
  const CUresult result = real_cuCtxGetCurrent(context);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  record(kCtxGetCurrent, 0, 0, 0, ns);
  pthread_mutex_unlock(&g_mutex);
  return result;
}

CUresult cuCtxSetCurrent(CUcontext context) {
  REAL(cuCtxSetCurrent);
  const uint64_t start = now_ns();
  const CUresult result = real_cuCtxSetCurrent(context);
  const uint64_t ns = now_ns() - start;
  pthread_mutex_lock(&g_mutex);
  record(kCtxSetCurrent, 0, context == NULL ? 0 : 1, 0, ns); /* mappings field: 1 = a context, 0 = none */
  pthread_mutex_unlock(&g_mutex);
  return result;
}
