/*
 * gpu-trace NVTX injection library.
 *
 * Loaded by every NVTX v3 user in the process through NVTX_INJECTION64_PATH; each copy of the
 * NVTX implementation (the `nvtx` Python package, torch, C/C++ libraries) calls
 * InitializeInjectionNvtx2 once, and we fill that copy's function table with our callbacks.
 *
 * Hot path: a thread-local state (allocated on a thread's first event), a per-thread stack of open
 * push/pop ranges, and a per-thread single-producer ring of fixed-size records. The owning thread
 * writes, the recorder's flusher thread drains through gt_drain(); no lock is taken on push, pop,
 * mark, start or end. A full ring drops the event and counts it. Drained timestamps are integer
 * nanoseconds of CLOCK_MONOTONIC, the clock of Python's time.perf_counter_ns on Linux.
 *
 * Clock: where the recorder asks for it (gt_set_clock, on x86-64 with an invariant TSC that the
 * kernel itself uses for CLOCK_MONOTONIC), the hot path reads the TSC (rdtsc, ~half the cost of a
 * vDSO clock_gettime) and gt_drain converts to CLOCK_MONOTONIC ns: calibration points, each a
 * (tsc, monotonic) pair read together, are taken when TSC mode starts and at every drain, and a
 * tick is mapped by linear interpolation between the two points around it (exact integer math).
 * Each point is exact, so the error is bounded by how much CLOCK_MONOTONIC's rate against the TSC
 * (NTP slewing) changes between two drains. Otherwise the hot path calls clock_gettime.
 *
 * Strings (messages, domain names, category names) are interned into one process-wide table of
 * ids; records carry ids, and the Python side drains new strings incrementally. ASCII and
 * converted Unicode messages go through a per-thread cache first, so the table's lock is taken only
 * the first time a thread sees a string. Registered string handles and domain handles are the ids
 * themselves.
 *
 * Fork: a pthread_atfork child handler drops the parent's events and other threads' states and
 * gives the forking thread a fresh span-id prefix; interned strings survive (handles stay valid).
 */
#define _GNU_SOURCE
#define NVTX_NO_IMPL
#include "nvtx3/nvToolsExt.h"

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <wchar.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#define GT_EXPORT __attribute__((visibility("default")))
#define GT_ABI_VERSION 2

enum { GT_RANGE = 1, GT_MARK = 2, GT_START = 3, GT_END = 4 };
/* flags: bit 0 color present; bits 4..7 NVTX payload type (1..6). */
#define GT_HAS_COLOR 1u

/* One record: 64 bytes, mirrored by a numpy structured dtype in collectors/nvtx/__init__.py. */
typedef struct gt_event {
    uint64_t span_id;
    uint64_t parent;
    int64_t start_ns; /* GT_END: the end time */
    int64_t end_ns;
    uint64_t payload; /* raw bits */
    uint32_t domain;  /* string id of the domain name, 0 = default domain */
    uint32_t name;    /* string id of the message */
    uint32_t category;
    uint32_t color; /* ARGB */
    uint16_t depth;
    uint8_t kind;
    uint8_t flags;
    uint32_t tid;
} gt_event;

_Static_assert(sizeof(gt_event) == 64, "gt_event must be 64 bytes");

typedef struct gt_frame {
    uint64_t span_id;
    uint64_t parent;
    int64_t start_ns;
    uint64_t payload;
    uint32_t domain, name, category, color;
    uint16_t depth;
    uint8_t flags;
    uint8_t open;
} __attribute__((aligned(64))) gt_frame; /* one cache line each */

#define GT_MAX_DEPTH 256
#define GT_CACHE 256
#define GT_MAX_MSG 4096

typedef struct gt_cache_entry {
    uint64_t hash;
    const char* s;
    uint32_t len;
    uint32_t id;
} gt_cache_entry;

typedef struct gt_thread {
    /* What every event touches, in the first cache line (the state is 64-byte aligned). The ring's
     * head is written by the owner, its tail (next line) by the drainer. */
    uint64_t head;
    gt_event* ring;
    uint64_t cap, mask;
    uint64_t prefix, seq;
    int top; /* number of frames in use */
    uint32_t tid;
    uint64_t limit; /* tail + cap as last read: the head may advance to here without reading tail */
    uint64_t tail;
    char pad1[56];
    uint64_t dropped; /* written by the owner (relaxed atomics) */
    int dead;         /* set when the thread exits */
    int overflow;
    size_t ring_bytes;
    gt_frame stack[GT_MAX_DEPTH];
    gt_cache_entry cache[GT_CACHE];
    char scratch[GT_MAX_MSG * 4 + 4];
    struct gt_thread* next;
} gt_thread;
_Static_assert(offsetof(gt_thread, tail) == 64, "the ring tail starts the second cache line");

/* ---- global state -------------------------------------------------------------------------- */

static pthread_mutex_t g_threads_lock = PTHREAD_MUTEX_INITIALIZER;
static gt_thread* g_threads;
static uint64_t g_dead_dropped;
static pthread_key_t g_key;
/* What every event reads, on one cache line: enabled (set by the recorder, gt_set_enabled, in
 * processes it records), the clock (gt_set_clock), and the string count that validates handles. */
static struct {
    int enabled;
    int tsc;
    uint32_t nstrs;
} g_hot __attribute__((aligned(64)));
#define g_enabled g_hot.enabled
#define g_tsc g_hot.tsc
#define g_nstrs g_hot.nstrs
static uint64_t g_capacity = 1u << 16;
static int g_init_count;
static uint64_t g_rng;

/* initial-exec: a plain %fs-relative load instead of a __tls_get_addr call on every event; one
 * pointer fits in the static TLS surplus glibc keeps for dlopen'ed libraries. */
static __thread gt_thread* t_state __attribute__((tls_model("initial-exec")));

/* string table */
typedef struct gt_str {
    char* s;
    uint32_t len;
    uint64_t hash;
} gt_str;

static pthread_mutex_t g_str_lock = PTHREAD_MUTEX_INITIALIZER;
static gt_str* g_strs;
static uint32_t g_strs_cap;
static uint32_t* g_index; /* open addressing: string id + 1, 0 empty */
static uint32_t g_index_cap;
static uint64_t g_str_bytes;
#define GT_MAX_STRINGS (1u << 22)
#define GT_MAX_STRING_BYTES (256ull << 20)
#define GT_SID_EMPTY 0
#define GT_SID_FULL 1

/* (domain, category, name) and (tid, name) tables, appended under g_str_lock */
static uint32_t* g_cats;
static size_t g_ncats, g_cats_cap;
static uint32_t* g_tnames;
static size_t g_ntnames, g_tnames_cap;

/* ---- helpers ------------------------------------------------------------------------------- */

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- the event clock ------------------------------------------------------------------------ */

/* 1: hot-path timestamps are TSC ticks, converted by gt_drain. Chosen before recording starts and
 * never changed afterwards (gt_set_clock), so a range never mixes the two units. */
static int g_clock_fixed = 0;

static inline int64_t stamp(void) {
#if defined(__x86_64__)
    if (__builtin_expect(__atomic_load_n(&g_tsc, __ATOMIC_RELAXED), 1)) return (int64_t)__rdtsc();
#endif
    return now_ns();
}

/* Calibration: points (tsc, mono) in increasing order, the newest GT_CALS kept; each segment
 * between neighbours carries its slope as integer + 64-bit binary fraction of ns per tick. */
#define GT_CALS 64
typedef struct gt_cal {
    int64_t tsc, mono;
    uint64_t q, frac; /* slope to the next point: q + frac / 2^64 ns per tick */
} gt_cal;
static gt_cal g_cal[GT_CALS];
static int g_ncal;

#if defined(__x86_64__)
/* One (tsc, mono) pair: the monotonic read bracketed by two TSC reads, the tightest of five. */
static void read_pair(int64_t* tsc, int64_t* mono) {
    uint64_t best = UINT64_MAX;
    for (int i = 0; i < 5; i++) {
        uint64_t a = __rdtsc();
        int64_t m = now_ns();
        uint64_t b = __rdtsc();
        if (b > a && b - a < best) {
            best = b - a;
            *tsc = (int64_t)(a + (b - a) / 2);
            *mono = m;
        }
    }
    if (best == UINT64_MAX) { /* the TSC did not advance: take what we have */
        *tsc = (int64_t)__rdtsc();
        *mono = now_ns();
    }
}
#endif

/* Append a calibration point (caller holds g_threads_lock). Points that don't move both clocks
 * forward are skipped: conversion then extrapolates from the last good segment. */
static void calibrate(void) {
#if defined(__x86_64__)
    int64_t tsc, mono;
    read_pair(&tsc, &mono);
    if (g_ncal > 0) {
        gt_cal* last = &g_cal[g_ncal - 1];
        if (tsc <= last->tsc || mono < last->mono) return;
        uint64_t dt = (uint64_t)(tsc - last->tsc), dm = (uint64_t)(mono - last->mono);
        last->q = dm / dt;
        last->frac = (uint64_t)(((unsigned __int128)(dm % dt) << 64) / dt);
        if (g_ncal == GT_CALS) {
            memmove(g_cal, g_cal + 1, (GT_CALS - 1) * sizeof(gt_cal));
            g_ncal--;
        }
    }
    g_cal[g_ncal].tsc = tsc;
    g_cal[g_ncal].mono = mono;
    g_cal[g_ncal].q = g_ncal > 0 ? g_cal[g_ncal - 1].q : 0;
    g_cal[g_ncal].frac = g_ncal > 0 ? g_cal[g_ncal - 1].frac : 0;
    g_ncal++;
#endif
}

/* TSC tick -> CLOCK_MONOTONIC ns by the segment around t (the first or last one extrapolated). */
static int64_t tsc_to_ns(int64_t t) {
    if (g_ncal < 2) return g_ncal ? g_cal[0].mono + (t - g_cal[0].tsc) : t; /* not reached */
    int lo = 0, hi = g_ncal - 2; /* segment index */
    if (t >= g_cal[hi].tsc) {
        lo = hi;
    } else {
        while (lo < hi) { /* the last segment starting at or before t */
            int mid = (lo + hi + 1) / 2;
            if (g_cal[mid].tsc <= t)
                lo = mid;
            else
                hi = mid - 1;
        }
    }
    const gt_cal* c = &g_cal[lo];
    uint64_t d = t >= c->tsc ? (uint64_t)(t - c->tsc) : (uint64_t)(c->tsc - t);
    uint64_t off = d * c->q + (uint64_t)(((unsigned __int128)d * c->frac) >> 64);
    return t >= c->tsc ? c->mono + (int64_t)off : c->mono - (int64_t)off;
}

static void convert_times(gt_event* ev, size_t n) {
    for (size_t i = 0; i < n; i++) {
        ev[i].start_ns = tsc_to_ns(ev[i].start_ns);
        if (ev[i].kind == GT_RANGE || ev[i].kind == GT_MARK) ev[i].end_ns = tsc_to_ns(ev[i].end_ns);
    }
}

static uint64_t splitmix(uint64_t* s) {
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* A random even 31-bit prefix in the high half: Python's ThreadBuffer prefixes are odd, so the two
 * id spaces never collide. */
static uint64_t new_prefix(void) {
    uint64_t s = __atomic_add_fetch(&g_rng, 0x9E3779B97F4A7C15ull, __ATOMIC_RELAXED);
    uint64_t r = splitmix(&s);
    return ((r & 0x7ffffffeull) | 2ull) << 32;
}

static void seed(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t s = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ ((uint64_t)getpid() << 40) ^
                 (uint64_t)(uintptr_t)&ts;
    __atomic_store_n(&g_rng, splitmix(&s), __ATOMIC_RELAXED);
}

static inline uint64_t fnv1a(const char* s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h ? h : 1;
}

/* ---- string interning ---------------------------------------------------------------------- */

static int str_grow_index(void) {
    uint32_t cap = g_index_cap ? g_index_cap * 2 : 1024;
    uint32_t* idx = calloc(cap, sizeof(uint32_t));
    if (!idx) return 0;
    for (uint32_t i = 0; i < g_nstrs; i++) {
        uint32_t j = (uint32_t)g_strs[i].hash & (cap - 1);
        while (idx[j]) j = (j + 1) & (cap - 1);
        idx[j] = i + 1;
    }
    free(g_index);
    g_index = idx;
    g_index_cap = cap;
    return 1;
}

/* Caller holds g_str_lock. Returns the id, GT_SID_FULL when the table is full. */
static uint32_t intern_locked(const char* s, uint32_t len, uint64_t h, const char** stable) {
    if (g_index_cap == 0 && !str_grow_index()) return GT_SID_FULL;
    uint32_t j = (uint32_t)h & (g_index_cap - 1);
    while (g_index[j]) {
        gt_str* e = &g_strs[g_index[j] - 1];
        if (e->hash == h && e->len == len && memcmp(e->s, s, len) == 0) {
            if (stable) *stable = e->s;
            return g_index[j] - 1;
        }
        j = (j + 1) & (g_index_cap - 1);
    }
    if (g_nstrs >= GT_MAX_STRINGS || g_str_bytes + len > GT_MAX_STRING_BYTES) return GT_SID_FULL;
    if (g_nstrs == g_strs_cap) {
        uint32_t cap = g_strs_cap ? g_strs_cap * 2 : 1024;
        gt_str* n = realloc(g_strs, cap * sizeof(gt_str));
        if (!n) return GT_SID_FULL;
        g_strs = n;
        g_strs_cap = cap;
    }
    char* copy = malloc(len + 1);
    if (!copy) return GT_SID_FULL;
    memcpy(copy, s, len);
    copy[len] = 0;
    uint32_t id = g_nstrs;
    g_strs[id].s = copy;
    g_strs[id].len = len;
    g_strs[id].hash = h;
    g_str_bytes += len;
    __atomic_store_n(&g_nstrs, id + 1, __ATOMIC_RELEASE);
    if ((uint64_t)g_nstrs * 2 > g_index_cap) {
        str_grow_index(); /* rebuilds, including the new id */
    } else {
        g_index[j] = id + 1;
    }
    if (stable) *stable = copy;
    return id;
}

static uint32_t intern(const char* s, uint32_t len) {
    uint64_t h = fnv1a(s, len);
    pthread_mutex_lock(&g_str_lock);
    uint32_t id = intern_locked(s, len, h, NULL);
    pthread_mutex_unlock(&g_str_lock);
    return id;
}

static void init_strings(void) {
    pthread_mutex_lock(&g_str_lock);
    if (g_nstrs == 0) {
        intern_locked("", 0, fnv1a("", 0), NULL);
        const char* full = "<gpu-trace: string table full>";
        intern_locked(full, (uint32_t)strlen(full), fnv1a(full, strlen(full)), NULL);
    }
    pthread_mutex_unlock(&g_str_lock);
}

/* Interning through the thread's cache: no lock when this thread has seen the string before. */
static uint32_t intern_cached(gt_thread* t, const char* s, size_t n) {
    if (n > GT_MAX_MSG) n = GT_MAX_MSG;
    uint64_t h = fnv1a(s, n);
    gt_cache_entry* c = &t->cache[h & (GT_CACHE - 1)];
    if (c->hash == h && c->len == n && c->s && memcmp(c->s, s, n) == 0) return c->id;
    const char* stable = NULL;
    pthread_mutex_lock(&g_str_lock);
    uint32_t id = intern_locked(s, (uint32_t)n, h, &stable);
    pthread_mutex_unlock(&g_str_lock);
    if (stable) {
        c->hash = h;
        c->s = stable;
        c->len = (uint32_t)n;
        c->id = id;
    }
    return id;
}

/* UTF-32 (Linux wchar_t) to UTF-8 into the thread's scratch buffer. */
static size_t wide_to_utf8(const wchar_t* w, char* out) {
    size_t o = 0;
    for (size_t i = 0; w[i] && i < GT_MAX_MSG; i++) {
        uint32_t c = (uint32_t)w[i];
        if (c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) c = 0xFFFD;
        if (c < 0x80) {
            out[o++] = (char)c;
        } else if (c < 0x800) {
            out[o++] = (char)(0xC0 | (c >> 6));
            out[o++] = (char)(0x80 | (c & 0x3F));
        } else if (c < 0x10000) {
            out[o++] = (char)(0xE0 | (c >> 12));
            out[o++] = (char)(0x80 | ((c >> 6) & 0x3F));
            out[o++] = (char)(0x80 | (c & 0x3F));
        } else {
            out[o++] = (char)(0xF0 | (c >> 18));
            out[o++] = (char)(0x80 | ((c >> 12) & 0x3F));
            out[o++] = (char)(0x80 | ((c >> 6) & 0x3F));
            out[o++] = (char)(0x80 | (c & 0x3F));
        }
    }
    return o;
}

static inline uint32_t ascii_id(gt_thread* t, const char* s) {
    return s ? intern_cached(t, s, strnlen(s, GT_MAX_MSG)) : GT_SID_EMPTY;
}

static inline uint32_t wide_id(gt_thread* t, const wchar_t* w) {
    if (!w) return GT_SID_EMPTY;
    size_t n = wide_to_utf8(w, t->scratch);
    return intern_cached(t, t->scratch, n);
}

/* Handles we gave out are string ids; anything else (a stale or foreign handle) reads as "". */
static inline uint32_t handle_id(const void* h) {
    uintptr_t v = (uintptr_t)h;
    return v < __atomic_load_n(&g_nstrs, __ATOMIC_ACQUIRE) ? (uint32_t)v : GT_SID_EMPTY;
}

/* ---- per-thread state ---------------------------------------------------------------------- */

static void thread_exit(void* p) {
    gt_thread* t = p;
    if (t_state == t) t_state = NULL;
    __atomic_store_n(&t->dead, 1, __ATOMIC_RELEASE);
}

static gt_thread* new_thread(void) {
    size_t size = (sizeof(gt_thread) + 63) & ~(size_t)63;
    gt_thread* t = aligned_alloc(64, size);
    if (!t) return NULL;
    memset(t, 0, size);
    uint64_t cap = __atomic_load_n(&g_capacity, __ATOMIC_RELAXED);
    t->ring_bytes = cap * sizeof(gt_event);
    void* ring = mmap(NULL, t->ring_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (ring == MAP_FAILED) {
        free(t);
        return NULL;
    }
    t->ring = ring;
    t->cap = cap;
    t->mask = cap - 1;
    t->tid = (uint32_t)syscall(SYS_gettid);
    t->prefix = new_prefix();
    pthread_mutex_lock(&g_threads_lock);
    t->next = g_threads;
    g_threads = t;
    pthread_mutex_unlock(&g_threads_lock);
    pthread_setspecific(g_key, t);
    t_state = t;
    return t;
}

static inline gt_thread* thread_state(void) {
    gt_thread* t = t_state;
    return t ? t : new_thread();
}

static inline uint64_t next_id(gt_thread* t) {
    if (++t->seq > 0xFFFFFFFFull) {
        t->prefix = new_prefix();
        t->seq = 1;
    }
    return t->prefix | t->seq;
}

/* The slot for the next record, or NULL (counted as dropped) when the ring is full. The drainer's
 * tail is read only when the head reaches the limit it allowed last time, so an event normally
 * touches none of the drainer's cache lines. */
static inline gt_event* slot(gt_thread* t) {
    if (__builtin_expect(t->head == t->limit, 0)) {
        t->limit = __atomic_load_n(&t->tail, __ATOMIC_ACQUIRE) + t->cap;
        if (t->head == t->limit) {
            __atomic_store_n(&t->dropped, t->dropped + 1, __ATOMIC_RELAXED);
            return NULL;
        }
    }
    return &t->ring[t->head & t->mask];
}

static inline void commit(gt_thread* t) { __atomic_store_n(&t->head, t->head + 1, __ATOMIC_RELEASE); }

/* ---- event attributes ---------------------------------------------------------------------- */

typedef struct gt_attrs {
    uint64_t payload;
    uint32_t name, category, color;
    uint8_t flags;
} gt_attrs;

#define HAS_FIELD(a, field) ((a)->size >= offsetof(nvtxEventAttributes_t, field) + sizeof((a)->field))

static inline void read_attrs(gt_thread* t, const nvtxEventAttributes_t* a, gt_attrs* out) {
    memset(out, 0, sizeof(*out));
    if (!a) return;
    if (HAS_FIELD(a, category)) out->category = a->category;
    if (HAS_FIELD(a, color) && a->colorType == NVTX_COLOR_ARGB) {
        out->color = a->color;
        out->flags |= GT_HAS_COLOR;
    }
    if (HAS_FIELD(a, payload) && a->payloadType >= NVTX_PAYLOAD_TYPE_UNSIGNED_INT64 &&
        a->payloadType <= NVTX_PAYLOAD_TYPE_FLOAT) {
        out->payload = a->payload.ullValue;
        if (a->payloadType >= NVTX_PAYLOAD_TYPE_UNSIGNED_INT32) out->payload &= 0xFFFFFFFFull;
        out->flags |= (uint8_t)(a->payloadType << 4);
    }
    if (HAS_FIELD(a, message)) {
        switch (a->messageType) {
        case NVTX_MESSAGE_TYPE_ASCII: out->name = ascii_id(t, a->message.ascii); break;
        case NVTX_MESSAGE_TYPE_UNICODE: out->name = wide_id(t, a->message.unicode); break;
        case NVTX_MESSAGE_TYPE_REGISTERED: out->name = handle_id(a->message.registered); break;
        default: break;
        }
    }
}

/* ---- push/pop ------------------------------------------------------------------------------ */

static inline gt_frame* innermost(gt_thread* t, uint32_t domain) {
    for (int i = t->top - 1; i >= 0; i--)
        if (t->stack[i].open && t->stack[i].domain == domain) return &t->stack[i];
    return NULL;
}

/* t: the calling thread's state (the callbacks have it already). */
static int push(gt_thread* t, uint32_t domain, const gt_attrs* at) {
    int64_t ts = stamp();
    if (t->top >= GT_MAX_DEPTH) {
        t->overflow++;
        __atomic_store_n(&t->dropped, t->dropped + 1, __ATOMIC_RELAXED);
        return GT_MAX_DEPTH;
    }
    gt_frame* parent = innermost(t, domain);
    gt_frame* f = &t->stack[t->top++];
    f->span_id = next_id(t);
    f->parent = parent ? parent->span_id : 0;
    f->start_ns = ts;
    f->payload = at->payload;
    f->domain = domain;
    f->name = at->name;
    f->category = at->category;
    f->color = at->color;
    f->flags = at->flags;
    f->depth = parent ? (uint16_t)(parent->depth + 1) : 0;
    f->open = 1;
    return f->depth;
}

static int pop(uint32_t domain) {
    gt_thread* t = t_state;
    if (!t) return -1;
    gt_frame* f = innermost(t, domain);
    if (!f) {
        if (t->overflow > 0) {
            t->overflow--;
            return GT_MAX_DEPTH;
        }
        return -1;
    }
    int depth = f->depth;
    if (__atomic_load_n(&g_enabled, __ATOMIC_RELAXED)) {
        int64_t ts = stamp();
        gt_event* e = slot(t);
        if (e) {
            e->span_id = f->span_id;
            e->parent = f->parent;
            e->start_ns = f->start_ns;
            e->end_ns = ts;
            e->payload = f->payload;
            e->domain = domain;
            e->name = f->name;
            e->category = f->category;
            e->color = f->color;
            e->depth = f->depth;
            e->kind = GT_RANGE;
            e->flags = f->flags;
            e->tid = t->tid;
            commit(t);
        }
    }
    f->open = 0;
    while (t->top > 0 && !t->stack[t->top - 1].open) t->top--;
    return depth;
}

static void mark(uint32_t domain, const gt_attrs* at) {
    gt_thread* t = thread_state();
    if (!t) return;
    int64_t ts = stamp();
    gt_frame* parent = innermost(t, domain);
    gt_event* e = slot(t);
    if (!e) return;
    e->span_id = next_id(t);
    e->parent = parent ? parent->span_id : 0;
    e->start_ns = ts;
    e->end_ns = ts;
    e->payload = at->payload;
    e->domain = domain;
    e->name = at->name;
    e->category = at->category;
    e->color = at->color;
    e->depth = parent ? (uint16_t)(parent->depth + 1) : 0;
    e->kind = GT_MARK;
    e->flags = at->flags;
    e->tid = t->tid;
    commit(t);
}

static nvtxRangeId_t start(uint32_t domain, const gt_attrs* at) {
    gt_thread* t = thread_state();
    if (!t) return 0;
    int64_t ts = stamp();
    uint64_t id = next_id(t);
    gt_event* e = slot(t);
    if (!e) return 0;
    e->span_id = id;
    e->parent = 0;
    e->start_ns = ts;
    e->end_ns = 0;
    e->payload = at->payload;
    e->domain = domain;
    e->name = at->name;
    e->category = at->category;
    e->color = at->color;
    e->depth = 0;
    e->kind = GT_START;
    e->flags = at->flags;
    e->tid = t->tid;
    commit(t);
    return id;
}

static void end(nvtxRangeId_t id) {
    if (id == 0 || !__atomic_load_n(&g_enabled, __ATOMIC_RELAXED)) return;
    gt_thread* t = thread_state();
    if (!t) return;
    int64_t ts = stamp();
    gt_event* e = slot(t);
    if (!e) return;
    memset(e, 0, sizeof(*e));
    e->span_id = id;
    e->start_ns = ts;
    e->kind = GT_END;
    e->tid = t->tid;
    commit(t);
}

#define ENABLED() __atomic_load_n(&g_enabled, __ATOMIC_RELAXED)
#define DOMAIN(d) handle_id(d)

/* ---- callbacks ----------------------------------------------------------------------------- */

static void NVTX_API cb_DomainMarkEx(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
    gt_thread* t;
    if (!ENABLED() || !(t = thread_state())) return;
    gt_attrs at;
    read_attrs(t, a, &at);
    mark(DOMAIN(d), &at);
}
static nvtxRangeId_t NVTX_API cb_DomainRangeStartEx(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
    gt_thread* t;
    if (!ENABLED() || !(t = thread_state())) return 0;
    gt_attrs at;
    read_attrs(t, a, &at);
    return start(DOMAIN(d), &at);
}
static void NVTX_API cb_DomainRangeEnd(nvtxDomainHandle_t d, nvtxRangeId_t id) {
    (void)d;
    end(id);
}
static int NVTX_API cb_DomainRangePushEx(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
    gt_thread* t;
    if (!ENABLED() || !(t = thread_state())) return NVTX_NO_PUSH_POP_TRACKING;
    gt_attrs at;
    read_attrs(t, a, &at);
    return push(t, DOMAIN(d), &at);
}
static int NVTX_API cb_DomainRangePop(nvtxDomainHandle_t d) { return pop(DOMAIN(d)); }

static void NVTX_API cb_MarkEx(const nvtxEventAttributes_t* a) { cb_DomainMarkEx(NULL, a); }
static void NVTX_API cb_MarkA(const char* m) {
    gt_thread* t;
    if (!ENABLED() || !(t = thread_state())) return;
    gt_attrs at = {0};
    at.name = ascii_id(t, m);
    mark(0, &at);
}
static void NVTX_API cb_MarkW(const wchar_t* m) {
    gt_thread* t;
    if (!ENABLED() || !(t = thread_state())) return;
    gt_attrs at = {0};
    at.name = wide_id(t, m);
    mark(0, &at);
}
static nvtxRangeId_t NVTX_API cb_RangeStartEx(const nvtxEventAttributes_t* a) { return cb_DomainRangeStartEx(NULL, a); }
static nvtxRangeId_t NVTX_API cb_RangeStartA(const char* m) {
    gt_thread* t;
    if (!ENABLED() || !(t = thread_state())) return 0;
    gt_attrs at = {0};
    at.name = ascii_id(t, m);
    return start(0, &at);
}
static nvtxRangeId_t NVTX_API cb_RangeStartW(const wchar_t* m) {
    gt_thread* t;
    if (!ENABLED() || !(t = thread_state())) return 0;
    gt_attrs at = {0};
    at.name = wide_id(t, m);
    return start(0, &at);
}
static void NVTX_API cb_RangeEnd(nvtxRangeId_t id) { end(id); }
static int NVTX_API cb_RangePushEx(const nvtxEventAttributes_t* a) { return cb_DomainRangePushEx(NULL, a); }
static int NVTX_API cb_RangePushA(const char* m) {
    gt_thread* t;
    if (!ENABLED() || !(t = thread_state())) return NVTX_NO_PUSH_POP_TRACKING;
    gt_attrs at = {0};
    at.name = ascii_id(t, m);
    return push(t, 0, &at);
}
static int NVTX_API cb_RangePushW(const wchar_t* m) {
    gt_thread* t;
    if (!ENABLED() || !(t = thread_state())) return NVTX_NO_PUSH_POP_TRACKING;
    gt_attrs at = {0};
    at.name = wide_id(t, m);
    return push(t, 0, &at);
}
static int NVTX_API cb_RangePop(void) { return pop(0); }

static void add_pair(uint32_t** arr, size_t* n, size_t* cap, size_t width, const uint32_t* vals) {
    if (*n == *cap) {
        size_t c = *cap ? *cap * 2 : 64;
        uint32_t* p = realloc(*arr, c * width * sizeof(uint32_t));
        if (!p) return;
        *arr = p;
        *cap = c;
    }
    memcpy(*arr + *n * width, vals, width * sizeof(uint32_t));
    (*n)++;
}

static void name_category(uint32_t domain, uint32_t category, uint32_t name) {
    uint32_t v[3] = {domain, category, name};
    pthread_mutex_lock(&g_str_lock);
    add_pair(&g_cats, &g_ncats, &g_cats_cap, 3, v);
    pthread_mutex_unlock(&g_str_lock);
}
static void name_thread(uint32_t tid, uint32_t name) {
    uint32_t v[2] = {tid, name};
    pthread_mutex_lock(&g_str_lock);
    add_pair(&g_tnames, &g_ntnames, &g_tnames_cap, 2, v);
    pthread_mutex_unlock(&g_str_lock);
}

static uint32_t str_id_a(const char* s) { return s ? intern(s, (uint32_t)strnlen(s, GT_MAX_MSG)) : GT_SID_EMPTY; }
static uint32_t str_id_w(const wchar_t* w) {
    gt_thread* t = thread_state();
    if (!w || !t) return GT_SID_EMPTY;
    size_t n = wide_to_utf8(w, t->scratch);
    return intern(t->scratch, (uint32_t)n);
}

static void NVTX_API cb_DomainNameCategoryA(nvtxDomainHandle_t d, uint32_t c, const char* n) { name_category(DOMAIN(d), c, str_id_a(n)); }
static void NVTX_API cb_DomainNameCategoryW(nvtxDomainHandle_t d, uint32_t c, const wchar_t* n) { name_category(DOMAIN(d), c, str_id_w(n)); }
static void NVTX_API cb_NameCategoryA(uint32_t c, const char* n) { name_category(0, c, str_id_a(n)); }
static void NVTX_API cb_NameCategoryW(uint32_t c, const wchar_t* n) { name_category(0, c, str_id_w(n)); }
static void NVTX_API cb_NameOsThreadA(uint32_t tid, const char* n) { name_thread(tid, str_id_a(n)); }
static void NVTX_API cb_NameOsThreadW(uint32_t tid, const wchar_t* n) { name_thread(tid, str_id_w(n)); }

static nvtxStringHandle_t NVTX_API cb_DomainRegisterStringA(nvtxDomainHandle_t d, const char* s) {
    (void)d;
    return (nvtxStringHandle_t)(uintptr_t)str_id_a(s);
}
static nvtxStringHandle_t NVTX_API cb_DomainRegisterStringW(nvtxDomainHandle_t d, const wchar_t* s) {
    (void)d;
    return (nvtxStringHandle_t)(uintptr_t)str_id_w(s);
}
/* A domain handle is its name's string id; an empty or missing name is the default domain (NULL). */
static nvtxDomainHandle_t NVTX_API cb_DomainCreateA(const char* name) { return (nvtxDomainHandle_t)(uintptr_t)str_id_a(name); }
static nvtxDomainHandle_t NVTX_API cb_DomainCreateW(const wchar_t* name) { return (nvtxDomainHandle_t)(uintptr_t)str_id_w(name); }
static void NVTX_API cb_DomainDestroy(nvtxDomainHandle_t d) { (void)d; }
static void NVTX_API cb_Initialize(const void* reserved) { (void)reserved; }

/* ---- fork ---------------------------------------------------------------------------------- */

static void before_fork(void) {
    pthread_mutex_lock(&g_str_lock);
    pthread_mutex_lock(&g_threads_lock);
}

static void after_fork_parent(void) {
    pthread_mutex_unlock(&g_threads_lock);
    pthread_mutex_unlock(&g_str_lock);
}

/* Only the forking thread exists in the child: forget every other thread's state and all buffered
 * events, and give this thread a new id prefix so the child's ids differ from the parent's. */
static void after_fork_child(void) {
    pthread_mutex_init(&g_threads_lock, NULL);
    pthread_mutex_init(&g_str_lock, NULL);
    seed();
    gt_thread* self = t_state;
    gt_thread* t = g_threads;
    while (t) {
        gt_thread* next = t->next;
        if (t != self) {
            munmap(t->ring, t->ring_bytes);
            free(t);
        }
        t = next;
    }
    g_threads = self;
    g_dead_dropped = 0;
    if (self) {
        self->next = NULL;
        self->head = self->tail = self->limit = 0;
        self->dropped = 0;
        self->top = 0;
        self->overflow = 0;
        self->seq = 0;
        self->prefix = new_prefix();
        self->tid = (uint32_t)syscall(SYS_gettid);
    }
}

__attribute__((constructor)) static void gt_load(void) {
    seed();
    init_strings();
    pthread_key_create(&g_key, thread_exit);
    pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

/* ---- NVTX entry point ---------------------------------------------------------------------- */

static void set_fn(NvtxFunctionTable table, unsigned int size, unsigned int id, void* fn) {
    if (table && id <= size && table[id]) *table[id] = (NvtxFunctionPointer)fn;
}

GT_EXPORT int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t get) {
    if (!get) return 0;
    const NvtxExportTableCallbacks* cb = (const NvtxExportTableCallbacks*)get(NVTX_ETID_CALLBACKS);
    if (!cb || cb->struct_size < sizeof(NvtxExportTableCallbacks) || !cb->GetModuleFunctionTable) return 0;
    NvtxFunctionTable core = NULL, core2 = NULL;
    unsigned int n1 = 0, n2 = 0;
    if (!cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE, &core, &n1) || !core) return 0;
    if (!cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &core2, &n2) || !core2) return 0;

    set_fn(core, n1, NVTX_CBID_CORE_MarkEx, (void*)cb_MarkEx);
    set_fn(core, n1, NVTX_CBID_CORE_MarkA, (void*)cb_MarkA);
    set_fn(core, n1, NVTX_CBID_CORE_MarkW, (void*)cb_MarkW);
    set_fn(core, n1, NVTX_CBID_CORE_RangeStartEx, (void*)cb_RangeStartEx);
    set_fn(core, n1, NVTX_CBID_CORE_RangeStartA, (void*)cb_RangeStartA);
    set_fn(core, n1, NVTX_CBID_CORE_RangeStartW, (void*)cb_RangeStartW);
    set_fn(core, n1, NVTX_CBID_CORE_RangeEnd, (void*)cb_RangeEnd);
    set_fn(core, n1, NVTX_CBID_CORE_RangePushEx, (void*)cb_RangePushEx);
    set_fn(core, n1, NVTX_CBID_CORE_RangePushA, (void*)cb_RangePushA);
    set_fn(core, n1, NVTX_CBID_CORE_RangePushW, (void*)cb_RangePushW);
    set_fn(core, n1, NVTX_CBID_CORE_RangePop, (void*)cb_RangePop);
    set_fn(core, n1, NVTX_CBID_CORE_NameCategoryA, (void*)cb_NameCategoryA);
    set_fn(core, n1, NVTX_CBID_CORE_NameCategoryW, (void*)cb_NameCategoryW);
    set_fn(core, n1, NVTX_CBID_CORE_NameOsThreadA, (void*)cb_NameOsThreadA);
    set_fn(core, n1, NVTX_CBID_CORE_NameOsThreadW, (void*)cb_NameOsThreadW);

    set_fn(core2, n2, NVTX_CBID_CORE2_DomainMarkEx, (void*)cb_DomainMarkEx);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainRangeStartEx, (void*)cb_DomainRangeStartEx);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainRangeEnd, (void*)cb_DomainRangeEnd);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainRangePushEx, (void*)cb_DomainRangePushEx);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainRangePop, (void*)cb_DomainRangePop);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainNameCategoryA, (void*)cb_DomainNameCategoryA);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainNameCategoryW, (void*)cb_DomainNameCategoryW);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainRegisterStringA, (void*)cb_DomainRegisterStringA);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainRegisterStringW, (void*)cb_DomainRegisterStringW);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainCreateA, (void*)cb_DomainCreateA);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainCreateW, (void*)cb_DomainCreateW);
    set_fn(core2, n2, NVTX_CBID_CORE2_DomainDestroy, (void*)cb_DomainDestroy);
    set_fn(core2, n2, NVTX_CBID_CORE2_Initialize, (void*)cb_Initialize);

    const NvtxExportTableVersionInfo* vi = (const NvtxExportTableVersionInfo*)get(NVTX_ETID_VERSIONINFO);
    if (vi && vi->struct_size >= sizeof(NvtxExportTableVersionInfo) && vi->SetInjectionNvtxVersion)
        vi->SetInjectionNvtxVersion(NVTX_VERSION);
    __atomic_add_fetch(&g_init_count, 1, __ATOMIC_RELAXED);
    return 1;
}

/* ---- the drain side (called from Python through ctypes) ------------------------------------ */

GT_EXPORT int gt_abi_version(void) { return GT_ABI_VERSION; }
GT_EXPORT size_t gt_record_size(void) { return sizeof(gt_event); }
GT_EXPORT int gt_init_count(void) { return __atomic_load_n(&g_init_count, __ATOMIC_RELAXED); }

/* Ring capacity (events, rounded up to a power of two) of threads that start recording later. */
GT_EXPORT void gt_configure(uint64_t capacity) {
    uint64_t c = 16;
    while (c < capacity && c < (1ull << 24)) c <<= 1;
    __atomic_store_n(&g_capacity, c, __ATOMIC_RELAXED);
}

/* The hot path's clock: 1 asks for the TSC (honoured on x86-64 only), 0 for clock_gettime. Only
 * the first call decides (a range must not start in one unit and end in the other); returns the
 * clock in effect, 1 for the TSC. The caller checks that the TSC is invariant and is the kernel's
 * clocksource. */
GT_EXPORT int gt_set_clock(int tsc) {
    pthread_mutex_lock(&g_threads_lock);
    if (!g_clock_fixed) {
        g_clock_fixed = 1;
#if defined(__x86_64__)
        if (tsc) {
            g_ncal = 0;
            calibrate();
            __atomic_store_n(&g_tsc, 1, __ATOMIC_RELEASE);
        }
#else
        (void)tsc;
#endif
    }
    int r = g_tsc;
    pthread_mutex_unlock(&g_threads_lock);
    return r;
}

GT_EXPORT void gt_set_enabled(int on) {
    if (on) {
        pthread_mutex_lock(&g_threads_lock);
        g_clock_fixed = 1; /* events are stamped from now on: the clock can't change any more */
        pthread_mutex_unlock(&g_threads_lock);
    }
    __atomic_store_n(&g_enabled, on ? 1 : 0, __ATOMIC_RELAXED);
}

/* Copy up to max buffered events into out; frees the states of exited threads once drained. */
GT_EXPORT size_t gt_drain(gt_event* out, size_t max) {
    size_t n = 0;
    pthread_mutex_lock(&g_threads_lock);
    gt_thread** link = &g_threads;
    while (*link) {
        gt_thread* t = *link;
        int dead = __atomic_load_n(&t->dead, __ATOMIC_ACQUIRE);
        uint64_t head = __atomic_load_n(&t->head, __ATOMIC_ACQUIRE);
        uint64_t tail = t->tail;
        uint64_t k = head - tail;
        if (k > max - n) k = max - n;
        while (k > 0) {
            uint64_t i = tail & t->mask;
            uint64_t seg = t->cap - i < k ? t->cap - i : k;
            memcpy(out + n, t->ring + i, seg * sizeof(gt_event));
            n += seg;
            tail += seg;
            k -= seg;
        }
        __atomic_store_n(&t->tail, tail, __ATOMIC_RELEASE);
        if (dead && tail == head) {
            *link = t->next;
            g_dead_dropped += __atomic_load_n(&t->dropped, __ATOMIC_RELAXED);
            munmap(t->ring, t->ring_bytes);
            free(t);
            continue;
        }
        link = &t->next;
        if (n == max) break;
    }
    if (g_tsc && n > 0) {
        /* After the copies: every event drained was stamped before this point. */
        calibrate();
        convert_times(out, n);
    }
    pthread_mutex_unlock(&g_threads_lock);
    return n;
}

GT_EXPORT uint64_t gt_dropped(void) {
    pthread_mutex_lock(&g_threads_lock);
    uint64_t d = g_dead_dropped;
    for (gt_thread* t = g_threads; t; t = t->next) d += __atomic_load_n(&t->dropped, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&g_threads_lock);
    return d;
}

GT_EXPORT uint32_t gt_string_count(void) { return __atomic_load_n(&g_nstrs, __ATOMIC_ACQUIRE); }

/* Copy strings [first, first+count) into buf (UTF-8, back to back) and their lengths into lens;
 * stops early when buf is full. Returns how many strings were copied. */
GT_EXPORT uint32_t gt_strings(uint32_t first, uint32_t count, char* buf, size_t bufsize, uint32_t* lens) {
    uint32_t done = 0;
    size_t used = 0;
    pthread_mutex_lock(&g_str_lock);
    for (uint32_t i = first; i < g_nstrs && done < count; i++, done++) {
        uint32_t len = g_strs[i].len;
        if (used + len > bufsize) break;
        memcpy(buf + used, g_strs[i].s, len);
        used += len;
        lens[done] = len;
    }
    pthread_mutex_unlock(&g_str_lock);
    return done;
}

/* Category names (domain id, category, name id) from index first; returns how many were copied. */
GT_EXPORT size_t gt_categories(size_t first, uint32_t* out, size_t max) {
    size_t k = 0;
    pthread_mutex_lock(&g_str_lock);
    for (size_t i = first; i < g_ncats && k < max; i++, k++) memcpy(out + 3 * k, g_cats + 3 * i, 3 * sizeof(uint32_t));
    pthread_mutex_unlock(&g_str_lock);
    return k;
}

/* Thread names (tid, name id) from index first. */
GT_EXPORT size_t gt_thread_names(size_t first, uint32_t* out, size_t max) {
    size_t k = 0;
    pthread_mutex_lock(&g_str_lock);
    for (size_t i = first; i < g_ntnames && k < max; i++, k++) memcpy(out + 2 * k, g_tnames + 2 * i, 2 * sizeof(uint32_t));
    pthread_mutex_unlock(&g_str_lock);
    return k;
}
