/* GPU activity capture: a CUPTI injection library the CUDA driver loads in every process.
 *
 * `gpu-trace record` names this library in CUDA_INJECTION64_PATH; the CUDA driver loads it at
 * cuInit in any process of the run (PyTorch, TensorFlow, JAX, CuPy, a C++ binary) and calls
 * InitializeInjection. No Python is in the loop and the program is not changed.
 *
 * libcupti is opened with dlopen (GPU_TRACE_CUPTI_LIBRARY, else "libcupti.so"), so this builds
 * with CUPTI's headers alone and a machine without CUPTI only loses GPU activity (one note).
 * CUPTI fills activity buffers on the program's threads (a few stores per record); it hands full
 * buffers to bufferCompleted on its own thread, where they are copied into the packed records of
 * activity.py's RECORD and appended to <GPU_TRACE_RUN_DIR>/spool/gpu_activity-<pid>-<tag>.bin
 * in checksummed chunks (activity_file.py). A thread of ours flushes every
 * GPU_TRACE_FLUSH_INTERVAL seconds; exit flushes the rest.
 *
 * No cuptiSubscribe: CUPTI allows one subscriber per process, and the Activity API needs none,
 * so the slot stays free for the program's own profiler (torch.profiler's Kineto subscribes).
 * Nothing here raises into, blocks or stops the program: every failure becomes a NOTE chunk.
 */
#define _GNU_SOURCE
#include <cupti.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))
#define BUFFER_BYTES (8u << 20)
#define ALIGN 8

enum { CH_RECORDS = 1, CH_NAMES = 2, CH_ANCHORS = 3, CH_STATS = 4, CH_NOTE = 5 };

/* activity.py's RECORD, field for field. */
struct __attribute__((packed)) gt_record {
    uint8_t kind, sub, src_kind, dst_kind;
    uint32_t device;
    int64_t start, end;
    uint32_t correlation, context, stream, pid;
    uint64_t tid;
    uint32_t code;
    int32_t ret;
    uint64_t bytes;
    int32_t grid[3], block[3];
    uint16_t registers, pad;
    uint32_t static_smem, dynamic_smem, reserved;
};
_Static_assert(sizeof(struct gt_record) == 104, "RECORD layout");

/* CUPTI entry points, resolved with dlsym. */
static CUptiResult (*p_enable)(CUpti_ActivityKind);
static CUptiResult (*p_disable)(CUpti_ActivityKind);
static CUptiResult (*p_register)(CUpti_BuffersCallbackRequestFunc, CUpti_BuffersCallbackCompleteFunc);
static CUptiResult (*p_next)(uint8_t *, size_t, CUpti_Activity **);
static CUptiResult (*p_flush)(uint32_t);
static CUptiResult (*p_dropped)(CUcontext, uint32_t, size_t *);
static CUptiResult (*p_timestamp)(uint64_t *);
static CUptiResult (*p_thread_id_type)(CUpti_ActivityThreadIdType);
static CUptiResult (*p_timestamp_callback)(CUpti_TimestampCallbackFunc);
static CUptiResult (*p_result_string)(CUptiResult, const char **);

static const char *result_string(CUptiResult r) {
    static __thread char text[160];
    const char *s = NULL;
    if (p_result_string && p_result_string(r, &s) == CUPTI_SUCCESS && s)
        snprintf(text, sizeof text, "%s", s);
    else
        snprintf(text, sizeof text, "CUPTI error %d", (int)r);
    return text;
}

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int fd = -1;
static char path[4096];
static int monotonic_clock; /* CUPTI stamps with our CLOCK_MONOTONIC reader */
static volatile int running;
/* The probe that tells whether CUPTI still hands its buffers to us (see flusher()). */
static CUresult (*p_driver_version)(int *);
static volatile uint64_t probe_tid;
static volatile int probe_seen, driver_enabled, system_tids;
static double flush_interval = 0.5;

/* ---- CRC-32 (zlib's), for the chunk checksums ------------------------------------------- */

static uint32_t crc_table[256];

static void crc_init(void) {
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++) c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[n] = c;
    }
}

static uint32_t crc32_of(const void *data, size_t len) {
    const uint8_t *p = data;
    uint32_t c = 0xFFFFFFFFu;
    while (len--) c = crc_table[(c ^ *p++) & 0xFF] ^ (c >> 8);
    return c ^ 0xFFFFFFFFu;
}

/* ---- the file ---------------------------------------------------------------------------- */

static int64_t monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static uint64_t CUPTIAPI monotonic_stamp(void) { return (uint64_t)monotonic_ns(); }

static int write_all(const void *data, size_t len) {
    const char *p = data;
    while (len) {
        ssize_t n = write(fd, p, len);
        if (n <= 0) return -1; /* a full disk: this chunk is lost, the program goes on */
        p += n;
        len -= (size_t)n;
    }
    return 0;
}

/* Open the file on first use (after fork, the child's own). Caller holds the lock. */
static int ensure_open(void) {
    if (fd >= 0) return 0;
    const char *run_dir = getenv("GPU_TRACE_RUN_DIR");
    if (!run_dir || !*run_dir) return -1;
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/spool", run_dir);
    mkdir(dir, 0755);
    unsigned tag = (unsigned)(monotonic_ns() ^ (getpid() << 8)) & 0xFFFFFF;
    snprintf(path, sizeof path, "%s/gpu_activity-%d-%06x.bin", dir, (int)getpid(), tag);
    fd = open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_APPEND, 0644);
    if (fd < 0) return -1;
    return write_all("GTACT001", 8);
}

static void chunk(uint32_t type, uint32_t count, const void *payload, uint32_t len) {
    if (ensure_open() != 0) return;
    uint32_t header[4] = {type, count, len, crc32_of(payload, len)};
    /* One writev: header and payload land together; a killed process leaves whole chunks, or a
     * truncated last one that the reader names and skips. */
    struct iovec io[2] = {{header, sizeof header}, {(void *)payload, len}};
    size_t total = sizeof header + len, done = 0;
    while (done < total) {
        ssize_t n = writev(fd, io, 2);
        if (n <= 0) return; /* a full disk: this chunk is lost, the program goes on */
        done += (size_t)n;
        for (int i = 0; i < 2; i++) { /* skip what was written */
            size_t take = (size_t)n < io[i].iov_len ? (size_t)n : io[i].iov_len;
            io[i].iov_base = (char *)io[i].iov_base + take;
            io[i].iov_len -= take;
            n -= (ssize_t)take;
        }
    }
}

static void note(const char *text) {
    pthread_mutex_lock(&lock);
    chunk(CH_NOTE, 1, text, (uint32_t)strlen(text));
    pthread_mutex_unlock(&lock);
}

/* A (CUPTI time, CLOCK_MONOTONIC) pair read together: the monotonic read bracketed by two
 * CUPTI reads, the tightest of five tries. Caller holds the lock. */
static void anchor(void) {
    int64_t pair[2];
    if (monotonic_clock) {
        int64_t now = monotonic_ns();
        pair[0] = pair[1] = now;
    } else {
        uint64_t best = UINT64_MAX;
        for (int i = 0; i < 5; i++) {
            uint64_t a = 0, b = 0;
            if (p_timestamp(&a) != CUPTI_SUCCESS) return;
            int64_t m = monotonic_ns();
            if (p_timestamp(&b) != CUPTI_SUCCESS) return;
            if (b - a < best) {
                best = b - a;
                pair[0] = (int64_t)(a + (b - a) / 2);
                pair[1] = m;
            }
        }
    }
    chunk(CH_ANCHORS, 1, pair, sizeof pair);
}

/* ---- kernel names: interned, each written once before the records that use it ------------ */

struct name_entry { char *name; uint32_t id; };
static struct name_entry *names;
static size_t names_cap, names_len;
static char *pending; /* NAMES chunk payload not yet written */
static size_t pending_len, pending_cap;
static uint32_t pending_count;

static uint64_t hash_str(const char *s) {
    uint64_t h = 1469598103934665603ull;
    while (*s) h = (h ^ (uint8_t)*s++) * 1099511628211ull;
    return h;
}

static uint32_t intern(const char *s) {
    if (!s) s = "";
    if (names_len * 2 >= names_cap) { /* grow and rehash */
        size_t cap = names_cap ? names_cap * 2 : 1024;
        struct name_entry *grown = calloc(cap, sizeof *grown);
        if (!grown) return 0xFFFFFFFFu;
        for (size_t i = 0; i < names_cap; i++) {
            if (!names[i].name) continue;
            size_t j = hash_str(names[i].name) & (cap - 1);
            while (grown[j].name) j = (j + 1) & (cap - 1);
            grown[j] = names[i];
        }
        free(names);
        names = grown;
        names_cap = cap;
    }
    size_t j = hash_str(s) & (names_cap - 1);
    while (names[j].name) {
        if (strcmp(names[j].name, s) == 0) return names[j].id;
        j = (j + 1) & (names_cap - 1);
    }
    uint32_t id = (uint32_t)names_len++;
    names[j].name = strdup(s);
    names[j].id = id;
    size_t len = strlen(s), need = pending_len + 8 + len;
    if (need > pending_cap) {
        size_t cap = need * 2;
        char *grown = realloc(pending, cap);
        if (!grown) return id;
        pending = grown;
        pending_cap = cap;
    }
    uint32_t head[2] = {id, (uint32_t)len};
    memcpy(pending + pending_len, head, 8);
    memcpy(pending + pending_len + 8, s, len);
    pending_len = need;
    pending_count++;
    return id;
}

/* ---- CUPTI's callbacks -------------------------------------------------------------------- */

static void CUPTIAPI buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records) {
    uint8_t *b = NULL;
    if (posix_memalign((void **)&b, ALIGN, BUFFER_BYTES) != 0) b = NULL;
    *buffer = b;
    *size = b ? BUFFER_BYTES : 0; /* no memory: CUPTI drops and counts the records */
    *max_records = 0;
}

static void convert(CUpti_Activity *a, struct gt_record *r, uint32_t pid) {
    memset(r, 0, sizeof *r);
    r->kind = (uint8_t)a->kind;
    r->pid = pid;
    switch (a->kind) {
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL:
    case CUPTI_ACTIVITY_KIND_KERNEL: {
        CUpti_ActivityKernel10 *k = (CUpti_ActivityKernel10 *)a;
        r->kind = CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL;
        r->device = k->deviceId;
        r->start = (int64_t)k->start;
        r->end = (int64_t)k->end;
        r->correlation = k->correlationId;
        r->context = k->contextId;
        r->stream = k->streamId;
        r->code = intern(k->name);
        r->grid[0] = k->gridX; r->grid[1] = k->gridY; r->grid[2] = k->gridZ;
        r->block[0] = k->blockX; r->block[1] = k->blockY; r->block[2] = k->blockZ;
        r->registers = k->registersPerThread;
        r->static_smem = (uint32_t)k->staticSharedMemory;
        r->dynamic_smem = (uint32_t)k->dynamicSharedMemory;
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
        CUpti_ActivityMemcpy6 *m = (CUpti_ActivityMemcpy6 *)a;
        r->sub = m->copyKind;
        r->src_kind = m->srcKind;
        r->dst_kind = m->dstKind;
        r->device = m->deviceId;
        r->start = (int64_t)m->start;
        r->end = (int64_t)m->end;
        r->correlation = m->correlationId;
        r->context = m->contextId;
        r->stream = m->streamId;
        r->bytes = m->bytes;
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
        CUpti_ActivityMemset4 *m = (CUpti_ActivityMemset4 *)a;
        r->sub = (uint8_t)m->memoryKind;
        r->device = m->deviceId;
        r->start = (int64_t)m->start;
        r->end = (int64_t)m->end;
        r->correlation = m->correlationId;
        r->context = m->contextId;
        r->stream = m->streamId;
        r->bytes = m->bytes;
        break;
    }
    case CUPTI_ACTIVITY_KIND_RUNTIME:
    case CUPTI_ACTIVITY_KIND_DRIVER: {
        CUpti_ActivityAPI *c = (CUpti_ActivityAPI *)a;
        r->start = (int64_t)c->start;
        r->end = (int64_t)c->end;
        r->correlation = c->correlationId;
        r->pid = c->processId ? c->processId : pid;
        r->tid = c->threadId;
        r->code = c->cbid;
        r->ret = (int32_t)c->returnValue;
        if (a->kind == CUPTI_ACTIVITY_KIND_DRIVER && probe_tid && c->threadId == probe_tid &&
            c->cbid == CUPTI_DRIVER_TRACE_CBID_cuDriverGetVersion) {
            probe_seen = 1;
            r->kind = 0; /* our own probe, not the program's */
        }
        break;
    }
    case CUPTI_ACTIVITY_KIND_SYNCHRONIZATION: {
        CUpti_ActivitySynchronization2 *s = (CUpti_ActivitySynchronization2 *)a;
        r->sub = (uint8_t)s->type;
        r->device = 0xFFFFFFFFu;
        r->start = (int64_t)s->start;
        r->end = (int64_t)s->end;
        r->correlation = s->correlationId;
        r->context = s->contextId;
        r->stream = s->streamId;
        break;
    }
    default:
        r->kind = 0; /* a kind we did not ask for */
    }
}

static void CUPTIAPI buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                      size_t valid) {
    (void)size;
    size_t cap = valid / sizeof(CUpti_ActivityAPI) + 1, n = 0; /* the smallest record */
    struct gt_record *out = malloc(cap * sizeof *out);
    uint32_t pid = (uint32_t)getpid();
    CUpti_Activity *a = NULL;
    pthread_mutex_lock(&lock);
    while (out && valid && p_next(buffer, valid, &a) == CUPTI_SUCCESS) {
        if (n == cap) {
            struct gt_record *grown = realloc(out, cap * 2 * sizeof *out);
            if (!grown) break;
            out = grown;
            cap *= 2;
        }
        convert(a, &out[n], pid);
        if (out[n].kind) n++;
    }
    if (pending_count) {
        chunk(CH_NAMES, pending_count, pending, (uint32_t)pending_len);
        pending_len = 0;
        pending_count = 0;
    }
    if (n) chunk(CH_RECORDS, (uint32_t)n, out, (uint32_t)(n * sizeof *out));
    size_t dropped = 0;
    if (p_dropped(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped) {
        uint64_t stats[2] = {dropped, n};
        chunk(CH_STATS, 1, stats, sizeof stats);
    }
    anchor();
    pthread_mutex_unlock(&lock);
    free(out);
    free(buffer);
}

/* ---- set-up, flushing, exit --------------------------------------------------------------- */

static const CUpti_ActivityKind KINDS[] = {
    CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL, CUPTI_ACTIVITY_KIND_MEMCPY,
    CUPTI_ACTIVITY_KIND_MEMSET,            CUPTI_ACTIVITY_KIND_RUNTIME,
    CUPTI_ACTIVITY_KIND_DRIVER,            CUPTI_ACTIVITY_KIND_SYNCHRONIZATION,
};

/* Every flush interval: hand CUPTI's filled buffers over. Every PROBE_EVERY intervals, when the
 * driver API kind is on: make one cheap driver call on this thread (cuDriverGetVersion) and force
 * a flush. Its record comes back to bufferCompleted as long as CUPTI's activity buffers are ours;
 * if it stops coming back twice in a row, another profiler in the program (torch.profiler with
 * CUDA activities: Kineto registers its own buffer callbacks, and CUPTI keeps one pair per
 * process) has taken them. Its profiler keeps working; we say so once and stop probing. A forced
 * flush every few seconds also bounds what a killed process loses. */
#define PROBE_EVERY 4

static void *flusher(void *arg) {
    (void)arg;
    struct timespec ts = {(time_t)flush_interval,
                          (long)((flush_interval - (time_t)flush_interval) * 1e9)};
    probe_tid = (uint64_t)syscall(SYS_gettid);
    /* the probe's record is told by its thread: only where CUPTI reports system thread ids */
    int tick = 0, misses = 0, pending = 0;
    int probing = p_driver_version && driver_enabled && system_tids;
    while (running) {
        nanosleep(&ts, NULL);
        if (!running) break;
        if (!probing || ++tick % PROBE_EVERY) {
            p_flush(0);
            continue;
        }
        if (pending) { /* the last probe had a whole period to come back */
            misses = probe_seen ? 0 : misses + 1;
            if (misses == 2) {
                char text[256];
                snprintf(text, sizeof text,
                         "GPU activity of process %d ends at %lld ns: another profiler in the "
                         "program (torch.profiler with CUDA activities?) took CUPTI's activity "
                         "buffers; it keeps them, the rest of the recording goes on",
                         (int)getpid(), (long long)monotonic_ns());
                note(text);
                probing = 0;
                continue;
            }
        }
        probe_seen = 0;
        int version = 0;
        p_driver_version(&version);
        p_flush(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
        pending = 1;
    }
    return NULL;
}

static void at_exit(void) {
    if (!running) return;
    running = 0;
    p_flush(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
    pthread_mutex_lock(&lock);
    if (fd >= 0) close(fd);
    fd = -1;
    pthread_mutex_unlock(&lock);
}

static void after_fork_child(void) {
    /* The parent's file is the parent's: the child writes its own, if it uses CUDA at all. */
    fd = -1;
    pthread_mutex_init(&lock, NULL);
}

#define RESOLVE(lib, var, name) (*(void **)&(var) = dlsym((lib), (name)))

EXPORT int InitializeInjection(void) {
    static int done;
    if (done++) return 1;
    crc_init();
    const char *interval = getenv("GPU_TRACE_FLUSH_INTERVAL");
    if (interval && atof(interval) > 0) flush_interval = atof(interval);
    const char *wanted = getenv("GPU_TRACE_CUPTI_LIBRARY");
    void *lib = dlopen(wanted && *wanted ? wanted : "libcupti.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib && !(wanted && *wanted)) lib = dlopen("libcupti.so.13", RTLD_NOW | RTLD_LOCAL);
    if (!lib && !(wanted && *wanted)) lib = dlopen("libcupti.so.12", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        char text[512];
        snprintf(text, sizeof text, "GPU activity is off: CUPTI not found (%s)", dlerror());
        note(text);
        return 1; /* the program runs on without it */
    }
    int ok = RESOLVE(lib, p_enable, "cuptiActivityEnable") && RESOLVE(lib, p_disable, "cuptiActivityDisable") &&
             RESOLVE(lib, p_register, "cuptiActivityRegisterCallbacks") &&
             RESOLVE(lib, p_next, "cuptiActivityGetNextRecord") &&
             RESOLVE(lib, p_flush, "cuptiActivityFlushAll") &&
             RESOLVE(lib, p_dropped, "cuptiActivityGetNumDroppedRecords") &&
             RESOLVE(lib, p_timestamp, "cuptiGetTimestamp");
    if (!ok) {
        note("GPU activity is off: this CUPTI lacks the Activity API entry points");
        return 1;
    }
    RESOLVE(lib, p_thread_id_type, "cuptiSetThreadIdType");
    RESOLVE(lib, p_timestamp_callback, "cuptiActivityRegisterTimestampCallback");
    RESOLVE(lib, p_result_string, "cuptiGetResultString");
    /* The driver that loaded us is in the process already: no new load, just its symbol. */
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    *(void **)&p_driver_version = driver ? dlsym(driver, "cuDriverGetVersion")
                                         : dlsym(RTLD_DEFAULT, "cuDriverGetVersion");
    /* Thread ids as the OS numbers them (gettid), the ids the recorder's spans carry. */
    system_tids = p_thread_id_type &&
                  p_thread_id_type(CUPTI_ACTIVITY_THREAD_ID_TYPE_SYSTEM) == CUPTI_SUCCESS;
    /* Times on the run's clock, from CUPTI itself where it can take our clock. */
    if (p_timestamp_callback && p_timestamp_callback(monotonic_stamp) == CUPTI_SUCCESS)
        monotonic_clock = 1;
    CUptiResult r = p_register(buffer_requested, buffer_completed);
    if (r != CUPTI_SUCCESS) {
        char text[256];
        snprintf(text, sizeof text,
                 "GPU activity is off: CUPTI's activity buffers are taken (%s; another "
                 "profiler, e.g. Nsight, holds CUPTI)", result_string(r));
        note(text);
        return 1;
    }
    int enabled = 0;
    CUptiResult failed = CUPTI_SUCCESS;
    char missing[128] = "";
    for (size_t i = 0; i < sizeof KINDS / sizeof *KINDS; i++) {
        r = p_enable(KINDS[i]);
        if (r == CUPTI_SUCCESS) {
            enabled++;
            driver_enabled |= KINDS[i] == CUPTI_ACTIVITY_KIND_DRIVER;
        } else {
            failed = r;
            size_t len = strlen(missing);
            snprintf(missing + len, sizeof missing - len, "%s%d", len ? ", " : "", (int)KINDS[i]);
        }
    }
    char text[512];
    if (!enabled) {
        snprintf(text, sizeof text, "GPU activity is off: CUPTI enabled no activity kind (%s)",
                 result_string(failed));
        note(text);
        return 1;
    }
    if (failed != CUPTI_SUCCESS) {
        snprintf(text, sizeof text, "GPU activity kinds %s not captured (%s)", missing,
                 result_string(failed));
        note(text);
    }
    if (!system_tids)
        note("CUPTI reports pthread ids here, not system thread ids: CUDA calls are not nested in ops");
    pthread_mutex_lock(&lock);
    anchor();
    pthread_mutex_unlock(&lock);
    running = 1;
    pthread_atfork(NULL, NULL, after_fork_child);
    atexit(at_exit);
    pthread_t t;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    if (pthread_create(&t, &attr, flusher, NULL) != 0)
        note("no GPU activity flusher thread: records are written when CUPTI's buffers fill");
    pthread_attr_destroy(&attr);
    return 1;
}

/* For tests: initialize as the driver would, and flush, without a GPU. */
EXPORT int gpu_trace_activity_flush(void) {
    if (!running) return -1;
    return p_flush(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED) == CUPTI_SUCCESS ? 0 : 1;
}
