/*
 * cuemu: a conformance model of the CUDA driver's virtual memory management (VMM) API, for
 * machines without a GPU. It is built by the test suite as a shared library whose DT_SONAME is
 * "libcuda.so.1" and loaded before the first driver call, so the REAL `cuda.bindings.driver`
 * (13.x: it dlopens libcuda.so.1, finds an already loaded one by soname, and fetches every
 * entry point through cuGetProcAddress_v2) calls into it, and vkv's real CudaBackend runs
 * unchanged. It models the documented rules; it measures nothing: no figure from it is ever
 * a GPU figure.
 *
 * "Device memory" is host memory: one memfd is the physical arena, cuMemCreate takes a slot of
 * it, a reservation is a PROT_NONE anonymous mapping, cuMemMap puts the slot there with
 * MAP_SHARED|MAP_FIXED (still inaccessible), cuMemSetAccess mprotects it, cuMemUnmap puts a
 * PROT_NONE mapping back. A page mapped at two addresses is one page, and every access the
 * rules forbid faults instead of passing.
 *
 * Strict where the documentation is (CUDA Driver API, Virtual Memory Management):
 *   cuMemCreate       size a multiple of the minimum granularity; flags 0
 *   cuMemAddressReserve  size a multiple of the host page; alignment a power of two or 0
 *   cuMemMap          offset 0, flags 0; ptr and size multiples of the granularity; inside one
 *                     reservation; only over unmapped addresses
 *   cuMemSetAccess    "a fully mapped address range": whole mappings, back to back
 *   cuMemUnmap        "the entire contiguous address range that was mapped": whole mappings
 *   cuMemAddressFree  exactly a reservation (pointer and size)
 *   cuMemRelease      deferred while mapped: the memory goes when the last mapping does
 *   cuMemCreate       requestedHandleTypes 0 or CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR (the one
 *                     shareable type on Linux here; others are not supported)
 *   cuMemExportToShareableHandle  only a handle created with that type requested; flags 0; each
 *                     call gives a new file descriptor, the caller's to close
 *   cuMemImportFromShareableHandle  the descriptor passed as (void *)(uintptr_t)fd; the handle it
 *                     gives is the importer's to cuMemRelease; the caller may close the fd at once
 *   physical memory of a shared allocation goes when every handle in every process is released
 *                     and every mapping unmapped
 * Emulator policy, where the documentation is silent (each marked "policy" below): freeing a
 * reservation that still holds mappings is refused; an unknown or released handle is refused;
 * with CUEMU_STRICT_CONTEXT (the default) every driver call but initialisation and context
 * management needs a current, retained context in the calling thread; new memory is filled
 * with 0xFF (NaN in every float type: device memory comes uninitialised); an allocation that may be
 * exported is a memfd of its own (the exported descriptor is a copy of it), so the kernel keeps
 * its pages while any process holds a descriptor or a mapping; an import keeps one open file per
 * handle (the real driver keeps none: cuInit raises the soft RLIMIT_NOFILE to the hard one); an
 * imported allocation counts in used bytes only in the process that created it.
 *
 * For tests: cuemu_stats() counts what is allocated, reserved and mapped; cuemu_fail(name, n,
 * code) makes the n-th next call of `name` fail with `code`.
 *
 * Build: cc -O2 -shared -fPIC -Wl,-soname,libcuda.so.1 -o libcuda.so.1 cuemu.c -lpthread
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <linux/falloc.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------ types from cuda.h */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

typedef struct {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;

typedef struct {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct { unsigned char compressionType, gpuDirectRDMACapable; unsigned short usage; unsigned char reserved[4]; } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemLocation) == 8, "CUmemLocation layout");
_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");

enum {
    CUDA_SUCCESS = 0, CUDA_ERROR_INVALID_VALUE = 1, CUDA_ERROR_OUT_OF_MEMORY = 2, CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101, CUDA_ERROR_INVALID_CONTEXT = 201, CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_UNKNOWN = 999,
};
static const struct { int code; const char *name, *text; } g_errors[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {CUDA_ERROR_UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"},
};
enum { HANDLE_NONE = 0, HANDLE_POSIX_FD = 1 }; /* CUmemAllocationHandleType */
enum { PINNED = 1, LOCATION_DEVICE = 1, PROT_NONE_ = 0, PROT_READ_ = 1, PROT_READWRITE_ = 3 };
enum { GET_PROC_SUCCESS = 0, GET_PROC_NOT_FOUND = 1, GET_PROC_VERSION_NOT_SUFFICIENT = 2 };

/* ------------------------------------------------------------------ state */
#define NDEV 1
#define GRANULARITY (2ull << 20)
#define DRIVER_VERSION 13050
#define SHAREABLE_NAME "cuemu-shareable-allocation"

struct CUctx_st { int device, retains; };
static struct CUctx_st g_primary[NDEV];
static __thread CUcontext tls_stack[16];
static __thread int tls_depth;

/* fd: the arena (g_memfd) at off, or a shareable allocation's own memfd at 0 */
struct alloc { size_t off, size; int handle_refs, mappings, fd, shareable, imported; };
struct resv { uintptr_t base; size_t size; };
struct mapping { uintptr_t va; size_t size; struct alloc *a; int access; };

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_inited, g_strict_context = 1;
static int g_memfd = -1;
static size_t g_arena, g_total = 16ull << 30, g_used;
static struct alloc **g_allocs; static size_t g_nallocs;       /* handle = (generation << 32) | index + 1 */
static unsigned *g_generations;
static size_t *g_free_offs; static size_t g_nfree_offs;         /* arena slots given back, reused by size */
static size_t *g_free_sizes;
static struct resv *g_resv; static size_t g_nresv;
static struct mapping *g_maps; static size_t g_nmaps;         /* sorted by va */
static struct { char name[64]; int countdown; CUresult code; } g_fault;

__attribute__((constructor)) static void cuemu_env(void) {
    const char *s;
    if ((s = getenv("CUEMU_STRICT_CONTEXT"))) g_strict_context = atoi(s) != 0;
    if ((s = getenv("CUEMU_TOTAL_MEM"))) g_total = strtoull(s, NULL, 0);
}

static void *grow(void *p, size_t n, size_t elt) { return realloc(p, (n + 1) * elt); }

static CUresult injected(const char *name) {
    if (g_fault.countdown <= 0 || strcmp(g_fault.name, name)) return CUDA_SUCCESS;
    return --g_fault.countdown == 0 ? g_fault.code : CUDA_SUCCESS;
}

static CUcontext current(void) { return tls_depth ? tls_stack[tls_depth - 1] : NULL; }
static int usable(CUcontext c) { return c >= g_primary && c < g_primary + NDEV && c->retains > 0; }

/* The checks every VMM call starts with, under the lock. */
static CUresult enter(const char *name) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (g_strict_context && !usable(current())) return CUDA_ERROR_INVALID_CONTEXT; /* policy */
    return injected(name);
}

/* ------------------------------------------------------------------ handles, ranges */
static CUmemGenericAllocationHandle handle_of(size_t index) {
    return ((unsigned long long)g_generations[index] << 32) | (index + 1);
}
static CUmemGenericAllocationHandle new_handle(struct alloc *a) {
    size_t index = 0;
    while (index < g_nallocs && g_allocs[index]) index++;
    if (index == g_nallocs) {
        g_allocs = grow(g_allocs, g_nallocs, sizeof *g_allocs);
        g_generations = grow(g_generations, g_nallocs, sizeof *g_generations);
        g_generations[g_nallocs++] = 1;
    }
    g_allocs[index] = a;
    return handle_of(index);
}
static struct alloc *lookup(CUmemGenericAllocationHandle h) {
    size_t index = (size_t)(h & 0xffffffffu) - 1;
    if ((h & 0xffffffffu) == 0 || index >= g_nallocs || !g_allocs[index]) return NULL;
    return g_generations[index] == (unsigned)(h >> 32) ? g_allocs[index] : NULL;
}
static void maybe_free(struct alloc *a) {
    if (a->handle_refs > 0 || a->mappings > 0) return;
    if (a->fd != g_memfd) {
        close(a->fd); /* the kernel frees the pages once no process holds a descriptor or a mapping */
    } else {
        fallocate(g_memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, (off_t)a->off, (off_t)a->size);
        g_free_offs = grow(g_free_offs, g_nfree_offs, sizeof *g_free_offs);
        g_free_sizes = grow(g_free_sizes, g_nfree_offs, sizeof *g_free_sizes);
        g_free_offs[g_nfree_offs] = a->off; g_free_sizes[g_nfree_offs++] = a->size;
    }
    if (!a->imported) g_used -= a->size;
    for (size_t i = 0; i < g_nallocs; i++)
        if (g_allocs[i] == a) { g_allocs[i] = NULL; g_generations[i]++; }
    free(a);
}
static struct resv *reservation_holding(uintptr_t p, size_t n) {
    for (size_t i = 0; i < g_nresv; i++)
        if (p >= g_resv[i].base && p + n <= g_resv[i].base + g_resv[i].size && p + n > p) return &g_resv[i];
    return NULL;
}
static size_t first_mapping_at_or_after(uintptr_t va) {
    size_t lo = 0, hi = g_nmaps;
    while (lo < hi) { size_t mid = (lo + hi) / 2; if (g_maps[mid].va < va) lo = mid + 1; else hi = mid; }
    return lo;
}
static int overlaps_mappings(uintptr_t p, size_t n) {
    size_t i = first_mapping_at_or_after(p);
    return (i < g_nmaps && g_maps[i].va < p + n) || (i > 0 && g_maps[i - 1].va + g_maps[i - 1].size > p);
}
/* [p, p + n) is whole mappings, back to back: the first starts at p and the last ends at p + n. */
static int whole_mappings(uintptr_t p, size_t n, size_t *first, size_t *count) {
    size_t i = first_mapping_at_or_after(p), j = i;
    uintptr_t end = p;
    if (i >= g_nmaps || g_maps[i].va != p) return 0;
    while (j < g_nmaps && g_maps[j].va == end && end < p + n) end += g_maps[j++].size;
    if (end != p + n) return 0;
    *first = i; *count = j - i;
    return 1;
}

/* ------------------------------------------------------------------ initialisation, errors */
EXPORT CUresult cuGetErrorName(CUresult e, const char **s) {
    for (size_t i = 0; s && i < sizeof g_errors / sizeof *g_errors; i++)
        if (g_errors[i].code == e) { *s = g_errors[i].name; return CUDA_SUCCESS; }
    if (s) *s = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuGetErrorString(CUresult e, const char **s) {
    for (size_t i = 0; s && i < sizeof g_errors / sizeof *g_errors; i++)
        if (g_errors[i].code == e) { *s = g_errors[i].text; return CUDA_SUCCESS; }
    if (s) *s = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}
EXPORT CUresult cuDriverGetVersion(int *v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = DRIVER_VERSION;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuInit(unsigned flags) {
    if (flags) return CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&g_lock);
    for (int d = 0; d < NDEV && !g_inited; d++) g_primary[d].device = d;
    struct rlimit files; /* policy: one open file per imported handle (see the top) */
    if (!g_inited && !getrlimit(RLIMIT_NOFILE, &files) && files.rlim_cur < files.rlim_max) {
        files.rlim_cur = files.rlim_max;
        setrlimit(RLIMIT_NOFILE, &files);
    }
    g_inited = 1;
    pthread_mutex_unlock(&g_lock);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGet(CUdevice *dev, int ordinal) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!dev) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
    *dev = ordinal;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetCount(int *n) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = NDEV;
    return CUDA_SUCCESS;
}

/* ------------------------------------------------------------------ contexts */
EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice dev) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (dev < 0 || dev >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    g_primary[dev].retains++;
    pthread_mutex_unlock(&g_lock);
    *ctx = &g_primary[dev];
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (dev < 0 || dev >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
    pthread_mutex_lock(&g_lock);
    CUresult r = g_primary[dev].retains > 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
    if (!r) g_primary[dev].retains--;
    pthread_mutex_unlock(&g_lock);
    return r;
}
EXPORT CUresult cuCtxGetCurrent(CUcontext *ctx) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    *ctx = current();
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx) { if (tls_depth) tls_depth--; return CUDA_SUCCESS; }
    if (ctx < g_primary || ctx >= g_primary + NDEV) return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_depth) tls_stack[tls_depth - 1] = ctx; else tls_stack[tls_depth++] = ctx;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuCtxSynchronize(void) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    return usable(current()) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT; /* nothing is ever in flight */
}
EXPORT CUresult cuCtxSynchronize_v2(CUcontext ctx) {
    if (!g_inited) return CUDA_ERROR_NOT_INITIALIZED;
    return usable(ctx ? ctx : current()) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/* ------------------------------------------------------------------ virtual memory management */
static CUresult check_prop(const CUmemAllocationProp *prop) {
    if (!prop || prop->type != PINNED || prop->location.type != LOCATION_DEVICE) return CUDA_ERROR_INVALID_VALUE;
    if (prop->location.id < 0 || prop->location.id >= NDEV) return CUDA_ERROR_INVALID_DEVICE;
    if (prop->requestedHandleTypes != HANDLE_NONE && prop->requestedHandleTypes != HANDLE_POSIX_FD)
        return CUDA_ERROR_NOT_SUPPORTED; /* Win32 handles and fabric handles: not on this emulator */
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemGetAllocationGranularity(size_t *g, const CUmemAllocationProp *prop, int option) {
    pthread_mutex_lock(&g_lock);
    CUresult r = enter("cuMemGetAllocationGranularity");
    if (!r) r = !g || (option != 0 && option != 1) ? CUDA_ERROR_INVALID_VALUE : check_prop(prop);
    if (!r) *g = GRANULARITY;
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                            unsigned long long flags) {
    pthread_mutex_lock(&g_lock);
    CUresult r = enter("cuMemCreate");
    if (!r && (!handle || flags || !size || size % GRANULARITY)) r = CUDA_ERROR_INVALID_VALUE;
    if (!r) r = check_prop(prop);
    if (!r && g_used + size > g_total) r = CUDA_ERROR_OUT_OF_MEMORY;
    if (r) goto out;
    if (g_memfd < 0 && (g_memfd = memfd_create("cuemu-device-memory", MFD_CLOEXEC)) < 0) { r = CUDA_ERROR_UNKNOWN; goto out; }
    struct alloc *a = calloc(1, sizeof *a);
    a->size = size; a->handle_refs = 1; a->fd = g_memfd;
    a->off = (size_t)-1;
    if (prop->requestedHandleTypes == HANDLE_POSIX_FD) { /* a file of its own, to be exported */
        a->shareable = 1; a->off = 0;
        if ((a->fd = memfd_create(SHAREABLE_NAME, MFD_CLOEXEC)) < 0) { free(a); r = CUDA_ERROR_UNKNOWN; goto out; }
        if (ftruncate(a->fd, (off_t)size)) { close(a->fd); free(a); r = CUDA_ERROR_OUT_OF_MEMORY; goto out; }
    }
    for (size_t i = 0; a->off == (size_t)-1 && i < g_nfree_offs; i++)  /* reuse a slot of the same size */
        if (g_free_sizes[i] == size) { a->off = g_free_offs[i]; g_free_offs[i] = g_free_offs[--g_nfree_offs];
                                       g_free_sizes[i] = g_free_sizes[g_nfree_offs]; break; }
    if (a->off == (size_t)-1) {
        a->off = g_arena;
        if (ftruncate(g_memfd, (off_t)(g_arena + size))) { free(a); r = CUDA_ERROR_OUT_OF_MEMORY; goto out; }
        g_arena += size;
    }
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, a->fd, (off_t)a->off);
    if (p != MAP_FAILED) { memset(p, 0xFF, size); munmap(p, size); } /* policy: uninitialised reads as NaN */
    g_used += size;
    *handle = new_handle(a);
out:
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    pthread_mutex_lock(&g_lock);
    CUresult r = enter("cuMemRelease");
    struct alloc *a = r ? NULL : lookup(handle);
    if (!r && (!a || a->handle_refs <= 0)) r = CUDA_ERROR_INVALID_VALUE; /* policy: undefined behaviour, refused */
    if (!r) { a->handle_refs--; maybe_free(a); }                         /* deferred while mapped */
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                                    unsigned long long flags) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    pthread_mutex_lock(&g_lock);
    CUresult r = enter("cuMemAddressReserve");
    if (!r && (!ptr || flags || !size || size % page || addr % page || (alignment & (alignment - 1))))
        r = CUDA_ERROR_INVALID_VALUE;
    if (r) goto out;
    size_t align = alignment > GRANULARITY ? alignment : GRANULARITY;
    void *p = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) { r = CUDA_ERROR_OUT_OF_MEMORY; goto out; }
    uintptr_t raw = (uintptr_t)p, base = (raw + align - 1) & ~(uintptr_t)(align - 1);
    if (base > raw) munmap(p, base - raw);
    if (raw + size + align > base + size) munmap((void *)(base + size), raw + size + align - base - size);
    g_resv = grow(g_resv, g_nresv, sizeof *g_resv);
    g_resv[g_nresv++] = (struct resv){base, size};
    *ptr = base;
out:
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&g_lock);
    CUresult r = enter("cuMemAddressFree");
    if (!r) {
        r = CUDA_ERROR_INVALID_VALUE;
        for (size_t i = 0; i < g_nresv; i++)
            if (g_resv[i].base == ptr && g_resv[i].size == size && !overlaps_mappings(ptr, size)) { /* policy */
                munmap((void *)(uintptr_t)ptr, size);
                g_resv[i] = g_resv[--g_nresv];
                r = CUDA_SUCCESS;
                break;
            }
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                         unsigned long long flags) {
    pthread_mutex_lock(&g_lock);
    CUresult r = enter("cuMemMap");
    struct alloc *a = r ? NULL : lookup(handle);
    if (!r && (flags || offset || !size || ptr % GRANULARITY || size % GRANULARITY || !a || size > a->size ||
               a->handle_refs <= 0 || /* released: its memory may live on in old mappings, the handle does not */
               !reservation_holding(ptr, size) || overlaps_mappings(ptr, size)))
        r = CUDA_ERROR_INVALID_VALUE;
    if (!r && mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, a->fd, (off_t)a->off) == MAP_FAILED)
        r = CUDA_ERROR_OUT_OF_MEMORY;
    if (!r) {
        size_t i = first_mapping_at_or_after(ptr);
        g_maps = grow(g_maps, g_nmaps, sizeof *g_maps);
        memmove(&g_maps[i + 1], &g_maps[i], (g_nmaps - i) * sizeof *g_maps);
        g_maps[i] = (struct mapping){ptr, size, a, PROT_NONE_};
        g_nmaps++;
        a->mappings++;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&g_lock);
    CUresult r = enter("cuMemUnmap");
    size_t first = 0, count = 0;
    if (!r && !whole_mappings(ptr, size, &first, &count)) r = CUDA_ERROR_INVALID_VALUE;
    if (!r && mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED,
                   -1, 0) == MAP_FAILED)
        r = CUDA_ERROR_UNKNOWN;
    if (!r) {
        for (size_t k = first; k < first + count; k++) { g_maps[k].a->mappings--; maybe_free(g_maps[k].a); }
        memmove(&g_maps[first], &g_maps[first + count], (g_nmaps - first - count) * sizeof *g_maps);
        g_nmaps -= count;
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

EXPORT CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const CUmemAccessDesc *desc, size_t count) {
    pthread_mutex_lock(&g_lock);
    CUresult r = enter("cuMemSetAccess");
    int access = -1;
    for (size_t k = 0; !r && k < count; k++) {
        if (desc[k].location.type != LOCATION_DEVICE || desc[k].location.id < 0 || desc[k].location.id >= NDEV)
            r = CUDA_ERROR_INVALID_DEVICE;
        else if (desc[k].flags != PROT_NONE_ && desc[k].flags != PROT_READ_ && desc[k].flags != PROT_READWRITE_)
            r = CUDA_ERROR_INVALID_VALUE;
        else
            access = desc[k].flags;
    }
    size_t first = 0, n = 0;
    if (!r && (!desc || !count || !whole_mappings(ptr, size, &first, &n))) r = CUDA_ERROR_INVALID_VALUE;
    int prot = access == PROT_READWRITE_ ? PROT_READ | PROT_WRITE : access == PROT_READ_ ? PROT_READ : PROT_NONE;
    if (!r && mprotect((void *)(uintptr_t)ptr, size, prot)) r = CUDA_ERROR_UNKNOWN;
    for (size_t k = first; !r && k < first + n; k++) g_maps[k].access = access;
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* ------------------------------------------------------------------ sharing between processes */
EXPORT CUresult cuMemExportToShareableHandle(void *shareable, CUmemGenericAllocationHandle handle, int type,
                                             unsigned long long flags) {
    pthread_mutex_lock(&g_lock);
    CUresult r = enter("cuMemExportToShareableHandle");
    struct alloc *a = r ? NULL : lookup(handle);
    if (!r && (!shareable || flags || !a || a->handle_refs <= 0)) r = CUDA_ERROR_INVALID_VALUE;
    if (!r && type != HANDLE_POSIX_FD) r = CUDA_ERROR_NOT_SUPPORTED;
    if (!r && !a->shareable) r = CUDA_ERROR_INVALID_VALUE; /* created without that handle type requested */
    int fd = r ? -1 : fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
    if (!r && fd < 0) r = CUDA_ERROR_OUT_OF_MEMORY; /* no descriptor left: the driver's resource error */
    if (!r) *(int *)shareable = fd;
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* An exported allocation's descriptor: a memfd the emulator named (policy: anything else is refused). */
static int exported_descriptor(int fd, size_t *size) {
    char link[64], target[128];
    struct stat st;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n < 0 || fstat(fd, &st)) return 0;
    target[n] = 0;
    if (strncmp(target, "/memfd:" SHAREABLE_NAME, strlen("/memfd:" SHAREABLE_NAME))) return 0;
    *size = (size_t)st.st_size;
    return *size > 0 && *size % GRANULARITY == 0;
}

EXPORT CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle *handle, void *os_handle, int type) {
    pthread_mutex_lock(&g_lock);
    CUresult r = enter("cuMemImportFromShareableHandle");
    size_t size = 0;
    int fd = (int)(intptr_t)os_handle;
    if (!r && type != HANDLE_POSIX_FD) r = CUDA_ERROR_NOT_SUPPORTED;
    if (!r && (!handle || fd < 0 || !exported_descriptor(fd, &size))) r = CUDA_ERROR_INVALID_VALUE;
    int own = r ? -1 : fcntl(fd, F_DUPFD_CLOEXEC, 0); /* the caller may close its descriptor at once */
    if (!r && own < 0) r = CUDA_ERROR_OUT_OF_MEMORY;
    if (!r) {
        struct alloc *a = calloc(1, sizeof *a);
        a->size = size; a->handle_refs = 1; a->fd = own; a->shareable = a->imported = 1;
        *handle = new_handle(a);
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* ------------------------------------------------------------------ entry points */
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    int *status);
EXPORT CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
/* (name, CUDA version the variant appeared in, implementation): the newest variant not newer
 * than the version asked for is returned, as the driver does; a name not listed is NULL. */
static const struct { const char *name; int version; void *fn; } g_procs[] = {
    {"cuGetErrorString", 6000, (void *)cuGetErrorString}, {"cuGetErrorName", 6000, (void *)cuGetErrorName},
    {"cuInit", 2000, (void *)cuInit}, {"cuDriverGetVersion", 2020, (void *)cuDriverGetVersion},
    {"cuDeviceGet", 2000, (void *)cuDeviceGet}, {"cuDeviceGetCount", 2000, (void *)cuDeviceGetCount},
    {"cuDevicePrimaryCtxRetain", 7000, (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", 11000, (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxGetCurrent", 4000, (void *)cuCtxGetCurrent}, {"cuCtxSetCurrent", 4000, (void *)cuCtxSetCurrent},
    {"cuCtxSynchronize", 2000, (void *)cuCtxSynchronize}, {"cuCtxSynchronize", 13000, (void *)cuCtxSynchronize_v2},
    {"cuMemGetAllocationGranularity", 10020, (void *)cuMemGetAllocationGranularity},
    {"cuMemCreate", 10020, (void *)cuMemCreate}, {"cuMemRelease", 10020, (void *)cuMemRelease},
    {"cuMemAddressReserve", 10020, (void *)cuMemAddressReserve}, {"cuMemAddressFree", 10020, (void *)cuMemAddressFree},
    {"cuMemMap", 10020, (void *)cuMemMap}, {"cuMemUnmap", 10020, (void *)cuMemUnmap},
    {"cuMemSetAccess", 10020, (void *)cuMemSetAccess},
    {"cuMemExportToShareableHandle", 10020, (void *)cuMemExportToShareableHandle},
    {"cuMemImportFromShareableHandle", 10020, (void *)cuMemImportFromShareableHandle},
    {"cuGetProcAddress", 11030, (void *)cuGetProcAddress}, {"cuGetProcAddress", 12000, (void *)cuGetProcAddress_v2},
};
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                                    int *status) {
    if (!symbol || !pfn || flags > 2) return CUDA_ERROR_INVALID_VALUE;
    *pfn = NULL;
    if (version > DRIVER_VERSION) return CUDA_ERROR_INVALID_VALUE;
    int found = 0, best = -1;
    for (size_t i = 0; i < sizeof g_procs / sizeof *g_procs; i++) {
        if (strcmp(g_procs[i].name, symbol)) continue;
        found = 1;
        if (g_procs[i].version <= version && (best < 0 || g_procs[i].version > g_procs[best].version)) best = (int)i;
    }
    if (best >= 0) *pfn = g_procs[best].fn;
    if (status) *status = best >= 0 ? GET_PROC_SUCCESS : found ? GET_PROC_VERSION_NOT_SUFFICIENT : GET_PROC_NOT_FOUND;
    return CUDA_SUCCESS; /* documented: success with a NULL pointer for what this driver lacks */
}

/* ------------------------------------------------------------------ for the tests */
struct cuemu_counts { size_t allocations, reservations, mappings, used_bytes; int context_retains; };
EXPORT void cuemu_stats(struct cuemu_counts *c) {
    pthread_mutex_lock(&g_lock);
    c->allocations = 0;
    for (size_t i = 0; i < g_nallocs; i++) c->allocations += g_allocs[i] != NULL;
    c->reservations = g_nresv; c->mappings = g_nmaps; c->used_bytes = g_used;
    c->context_retains = g_primary[0].retains;
    pthread_mutex_unlock(&g_lock);
}
EXPORT void cuemu_fail(const char *name, int nth, int code) {
    pthread_mutex_lock(&g_lock);
    snprintf(g_fault.name, sizeof g_fault.name, "%s", name);
    g_fault.countdown = nth; g_fault.code = code;
    pthread_mutex_unlock(&g_lock);
}
EXPORT void cuemu_set_strict_context(int on) { g_strict_context = on; }
