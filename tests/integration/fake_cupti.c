/* A stand-in libcupti for machines without a GPU: the Activity API entry points the injection
 * library calls, with CUPTI's record structs (from CUPTI's own headers), so that the library's
 * whole path runs here: InitializeInjection, buffer requests, record conversion, chunks, names,
 * anchors, drops, the exit flush. Only what this machine cannot have is replaced.
 *
 * fake_cupti_emit(corr, tid_out) "runs" a kernel launch: a cudaLaunchKernel runtime record, its
 * kernel, a memcpy, a memset and a stream synchronization, stamped with this fake's clock, which
 * is CLOCK_MONOTONIC + OFFSET_NS (unless the library registered a timestamp callback: then that).
 * Built with -DNO_TS_CALLBACK it lacks cuptiActivityRegisterTimestampCallback (older CUPTI).
 */
#define _GNU_SOURCE
#include <cupti.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define OFFSET_NS 1000000000000LL

static CUpti_BuffersCallbackRequestFunc requested;
static CUpti_BuffersCallbackCompleteFunc completed;
static CUpti_TimestampCallbackFunc stamp;
static int system_tids;
static uint8_t pending[4096];
static size_t pending_len;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static uint64_t now(void) {
    if (stamp) return stamp();
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec + OFFSET_NS;
}

EXPORT CUptiResult cuptiActivityEnable(CUpti_ActivityKind kind) { (void)kind; return CUPTI_SUCCESS; }
EXPORT CUptiResult cuptiActivityDisable(CUpti_ActivityKind kind) { (void)kind; return CUPTI_SUCCESS; }
EXPORT CUptiResult cuptiGetTimestamp(uint64_t *t) { *t = now(); return CUPTI_SUCCESS; }
EXPORT CUptiResult cuptiSetThreadIdType(CUpti_ActivityThreadIdType type) {
    system_tids = type == CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM;
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiGetResultString(CUptiResult r, const char **s) {
    *s = r == CUPTI_SUCCESS ? "CUPTI_SUCCESS" : "CUPTI_ERROR_FAKE";
    return CUPTI_SUCCESS;
}
#ifndef NO_TS_CALLBACK
EXPORT CUptiResult cuptiActivityRegisterTimestampCallback(CUpti_TimestampCallbackFunc f) {
    stamp = f;
    return CUPTI_SUCCESS;
}
#endif
EXPORT CUptiResult cuptiActivityRegisterCallbacks(CUpti_BuffersCallbackRequestFunc req,
                                                  CUpti_BuffersCallbackCompleteFunc done) {
    requested = req;
    completed = done;
    return CUPTI_SUCCESS;
}
EXPORT CUptiResult cuptiActivityGetNumDroppedRecords(CUcontext c, uint32_t s, size_t *n) {
    (void)c; (void)s;
    *n = 3; /* every buffer reports three records it could not hold */
    return CUPTI_SUCCESS;
}

static size_t record_size(const CUpti_Activity *a) {
    switch (a->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: return sizeof(CUpti_ActivityKernel10);
    case CUPTI_ACTIVITY_KIND_MEMCPY: return sizeof(CUpti_ActivityMemcpy6);
    case CUPTI_ACTIVITY_KIND_MEMSET: return sizeof(CUpti_ActivityMemset4);
    case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: return sizeof(CUpti_ActivitySynchronization2);
    default: return sizeof(CUpti_ActivityAPI);
    }
}

EXPORT CUptiResult cuptiActivityGetNextRecord(uint8_t *buffer, size_t valid, CUpti_Activity **rec) {
    uint8_t *next = *rec ? (uint8_t *)*rec + record_size(*rec) : buffer;
    if (next >= buffer + valid) return CUPTI_ERROR_MAX_LIMIT_REACHED;
    *rec = (CUpti_Activity *)next;
    return CUPTI_SUCCESS;
}

EXPORT CUptiResult cuptiActivityFlushAll(uint32_t flag) {
    (void)flag;
    pthread_mutex_lock(&lock);
    if (!pending_len || !requested || !completed) {
        pthread_mutex_unlock(&lock);
        return CUPTI_SUCCESS;
    }
    uint8_t *buf = NULL;
    size_t size = 0, max = 0;
    requested(&buf, &size, &max);
    size_t n = pending_len < size ? pending_len : size;
    memcpy(buf, pending, n);
    pending_len = 0;
    pthread_mutex_unlock(&lock);
    completed(NULL, 0, buf, size, n);
    return CUPTI_SUCCESS;
}

static void put(const void *rec, size_t size) {
    if (pending_len + size > sizeof pending) return; /* the fake's buffer is full: dropped */
    memcpy(pending + pending_len, rec, size);
    pending_len += size;
}

static uint32_t next_corr = 1000;

/* A driver call: CUPTI records it like any other (the library's probe makes this one). */
EXPORT CUresult cuDriverGetVersion(int *version) {
    pthread_mutex_lock(&lock);
    uint64_t t = now();
    CUpti_ActivityAPI api = {0};
    api.kind = CUPTI_ACTIVITY_KIND_DRIVER;
    api.cbid = 2; /* cuDriverGetVersion */
    api.start = t;
    api.end = t + 100;
    api.processId = (uint32_t)getpid();
    api.threadId = system_tids ? (uint32_t)syscall(SYS_gettid) : (uint32_t)pthread_self();
    api.correlationId = next_corr++;
    put(&api, sizeof api);
    pthread_mutex_unlock(&lock);
    *version = 13000;
    return CUDA_SUCCESS;
}

static void CUPTIAPI other_requested(uint8_t **buffer, size_t *size, size_t *max) {
    *buffer = malloc(4096);
    *size = 4096;
    *max = 0;
}

static void CUPTIAPI other_completed(CUcontext c, uint32_t s, uint8_t *buffer, size_t size,
                                     size_t valid) {
    (void)c; (void)s; (void)size; (void)valid;
    free(buffer);
}

/* What torch.profiler's Kineto does when the program starts it: its own buffer callbacks. */
EXPORT void fake_cupti_take_over(void) {
    pthread_mutex_lock(&lock);
    requested = other_requested;
    completed = other_completed;
    pthread_mutex_unlock(&lock);
}

EXPORT uint64_t fake_cupti_emit(uint32_t corr) {
    pthread_mutex_lock(&lock);
    uint64_t t = now();
    uint64_t tid = system_tids ? (uint64_t)syscall(SYS_gettid) : (uint32_t)pthread_self();
    CUpti_ActivityAPI api = {0};
    api.kind = CUPTI_ACTIVITY_KIND_RUNTIME;
    api.cbid = 211; /* cudaLaunchKernel */
    api.start = t;
    api.end = t + 1000;
    api.processId = (uint32_t)getpid();
    api.threadId = (uint32_t)tid;
    api.correlationId = corr;
    put(&api, sizeof api);
    CUpti_ActivityKernel10 k;
    memset(&k, 0, sizeof k);
    k.kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
    k.registersPerThread = 32;
    k.start = t + 2000;
    k.end = t + 5000;
    k.deviceId = 1;
    k.contextId = 4;
    k.streamId = 7;
    k.gridX = 8; k.gridY = 2; k.gridZ = 1;
    k.blockX = 256; k.blockY = 1; k.blockZ = 1;
    k.staticSharedMemory = 1024;
    k.dynamicSharedMemory = 2048;
    k.correlationId = corr;
    k.name = corr % 2 ? "_Z6kernelPf" : "_Z5otherv";
    put(&k, sizeof k);
    CUpti_ActivityMemcpy6 m;
    memset(&m, 0, sizeof m);
    m.kind = CUPTI_ACTIVITY_KIND_MEMCPY;
    m.copyKind = CUPTI_ACTIVITY_MEMCPY_KIND_DTOH;
    m.srcKind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
    m.dstKind = CUPTI_ACTIVITY_MEMORY_KIND_PINNED;
    m.bytes = 4096;
    m.start = t + 6000;
    m.end = t + 7000;
    m.deviceId = 1;
    m.contextId = 4;
    m.streamId = 7;
    m.correlationId = corr;
    put(&m, sizeof m);
    CUpti_ActivityMemset4 s;
    memset(&s, 0, sizeof s);
    s.kind = CUPTI_ACTIVITY_KIND_MEMSET;
    s.bytes = 64;
    s.start = t + 7100;
    s.end = t + 7200;
    s.deviceId = 1;
    s.contextId = 4;
    s.streamId = 7;
    s.correlationId = corr;
    s.memoryKind = CUPTI_ACTIVITY_MEMORY_KIND_DEVICE;
    put(&s, sizeof s);
    CUpti_ActivitySynchronization2 y;
    memset(&y, 0, sizeof y);
    y.kind = CUPTI_ACTIVITY_KIND_SYNCHRONIZATION;
    y.type = CUPTI_ACTIVITY_SYNCHRONIZATION_TYPE_STREAM_SYNCHRONIZE;
    y.start = t + 7300;
    y.end = t + 8000;
    y.contextId = 4;
    y.streamId = 7;
    y.correlationId = corr;
    put(&y, sizeof y);
    pthread_mutex_unlock(&lock);
    return tid;
}
