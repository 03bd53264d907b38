/*
 * gpu_trace.tracer._fastpath: the C twin of gpu_trace._api.PyRange (the public `gpu_trace.range`).
 *
 * Same contract, same records: entering a range allocates `buf.prefix + seq` as its span id and
 * pushes it on `buf.stack`; leaving it pops it and appends a span record (the layout of
 * gpu_trace.tracer.records.Span, field indices SPAN_* below)
 *     (span_id, parent_span_id, lane, category, name, start_ns, end_ns, depth, attrs)
 * to `buf.spans` (or counts `buf.dropped` when the buffer is at `buf.capacity`): the native twin of
 * ThreadBuffer.add_span, the one push of every Python producer. `buf` is the
 * calling thread's ThreadBuffer of the recorder in `gpu_trace.tracer.recorder.active`, found as
 * `rec._local.buf` or created once per thread by `rec.buffer()`. Times are CLOCK_MONOTONIC ns, the
 * clock of time.perf_counter_ns. Nothing raises into the program after construction: a failure is
 * handed to the `warn(what, exc)` callback given to configure() and the event is lost.
 *
 * The decorator form returns a `_wrapper` object (a callable with a __dict__, filled by
 * functools.update_wrapper, that binds as a method like a function) that does the same around each
 * call without allocating a range object.
 *
 * Speed: the ThreadBuffer's __slots__ are read at their offsets when the buffer is exactly a
 * ThreadBuffer (offsets taken from its member descriptors by configure()); anything else goes
 * through ordinary attribute access.
 *
 * Floods: a thread whose buffer is over half full gives the GIL way every 1024 spans (give_way),
 * and the flusher turns the spans into columns in one pass (span_columns, the C twin of
 * gpu_trace.tracer.columns), so one thread emitting ranges as fast as it can does not outrun
 * the flusher (docs/api.md, "Floods of ranges").
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <sched.h>
#include <time.h>

#ifndef Py_T_OBJECT_EX
#define Py_T_OBJECT_EX T_OBJECT_EX
#endif

/* ---- configuration (set once by configure()) ------------------------------------------------ */

static PyObject* g_recorder_dict; /* gpu_trace.tracer.recorder.__dict__ */
static PyObject* g_buffer_type;   /* ThreadBuffer */
static PyObject* g_lane;
static PyObject* g_category;
static PyObject* g_warn;          /* warn(what: str, exc: BaseException) */
static PyObject* g_update_wrapper;

/* Field indices of a span record: gpu_trace.tracer.records.SPAN_FIELDS, in that order (a test
 * holds them together). */
enum {
    SPAN_ID,
    SPAN_PARENT_SPAN_ID,
    SPAN_LANE,
    SPAN_CATEGORY,
    SPAN_NAME,
    SPAN_START_NS,
    SPAN_END_NS,
    SPAN_DEPTH,
    SPAN_ATTRS,
    SPAN_NFIELDS
};

enum { F_SPANS, F_STACK, F_CAPACITY, F_DROPPED, F_PREFIX, F_SEQ, F_COUNT };
static const char* const g_field_names[F_COUNT] = {"spans", "stack", "capacity", "dropped", "prefix", "seq"};
static PyObject* g_field_str[F_COUNT];
static Py_ssize_t g_field_off[F_COUNT]; /* 0: not a plain slot, use getattr */

static PyObject *s_active, *s_local, *s_buf, *s_buffer, *s_qualname;
static PyObject *g_zero, *g_one;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* ---- ThreadBuffer field access -------------------------------------------------------------- */

/* New reference to buf.<field>, or NULL with an exception set. */
static inline PyObject* field_get(PyObject* buf, int f) {
    Py_ssize_t off = g_field_off[f];
    if (off && (PyObject*)Py_TYPE(buf) == g_buffer_type) {
        PyObject* v = *(PyObject**)((char*)buf + off);
        if (v) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(buf, g_field_str[f]);
}

/* buf.<field> = v (steals nothing). 0 or -1 with an exception set. */
static inline int field_set(PyObject* buf, int f, PyObject* v) {
    Py_ssize_t off = g_field_off[f];
    if (off && (PyObject*)Py_TYPE(buf) == g_buffer_type) {
        PyObject** slot = (PyObject**)((char*)buf + off);
        PyObject* old = *slot;
        Py_INCREF(v);
        *slot = v;
        Py_XDECREF(old);
        return 0;
    }
    return PyObject_SetAttr(buf, g_field_str[f], v);
}

/* list.append(item) for a list or anything with an append method. 0 or -1. */
static inline int append(PyObject* seq, PyObject* item) {
    if (PyList_CheckExact(seq)) return PyList_Append(seq, item);
    PyObject* r = PyObject_CallMethod(seq, "append", "O", item);
    Py_XDECREF(r);
    return r ? 0 : -1;
}

/* ---- failures ------------------------------------------------------------------------------- */

/* The Python twin's `except Exception: _warn_once(what)`. Returns 0 when the error was swallowed,
 * -1 when it must propagate (a BaseException such as KeyboardInterrupt, as in the twin). */
static int swallow(const char* what) {
    if (!PyErr_ExceptionMatches(PyExc_Exception)) return -1;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (value && tb) PyException_SetTraceback(value, tb);
    if (g_warn && value) {
        PyObject* r = PyObject_CallFunction(g_warn, "sO", what, value);
        if (r)
            Py_DECREF(r);
        else
            PyErr_Clear();
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return 0;
}

/* ---- the shared enter/exit logic ------------------------------------------------------------ */

typedef struct {
    PyObject* buf; /* NULL: not recording */
    PyObject* sid;
    PyObject* parent;
    PyObject* depth;
    int64_t start;
} span_state;

static void state_clear(span_state* s) {
    Py_CLEAR(s->buf);
    Py_CLEAR(s->sid);
    Py_CLEAR(s->parent);
    Py_CLEAR(s->depth);
}

/* seq + 1 and prefix + seq as new references, in C when the ints are small. */
static int next_id(PyObject* buf, PyObject** out_seq, PyObject** out_sid) {
    PyObject* seq = field_get(buf, F_SEQ);
    if (!seq) return -1;
    PyObject* prefix = field_get(buf, F_PREFIX);
    if (!prefix) {
        Py_DECREF(seq);
        return -1;
    }
    PyObject *nseq = NULL, *sid = NULL;
    if (PyLong_CheckExact(seq) && PyLong_CheckExact(prefix)) {
        int o1 = 0, o2 = 0;
        long long s = PyLong_AsLongLongAndOverflow(seq, &o1);
        long long p = PyLong_AsLongLongAndOverflow(prefix, &o2);
        long long s1, id;
        if (!o1 && !o2 && !(s == -1 && PyErr_Occurred()) && !(p == -1 && PyErr_Occurred()) &&
            !__builtin_add_overflow(s, 1, &s1) && !__builtin_add_overflow(p, s1, &id)) {
            nseq = PyLong_FromLongLong(s1);
            sid = nseq ? PyLong_FromLongLong(id) : NULL;
            goto done;
        }
        PyErr_Clear();
    }
    nseq = PyNumber_Add(seq, g_one);
    sid = nseq ? PyNumber_Add(prefix, nseq) : NULL;
done:
    Py_DECREF(seq);
    Py_DECREF(prefix);
    if (!sid) {
        Py_XDECREF(nseq);
        return -1;
    }
    *out_seq = nseq;
    *out_sid = sid;
    return 0;
}

/* The active recorder's buffer for this thread: new reference, NULL with no exception when not
 * recording, NULL with an exception on failure. */
static PyObject* current_buffer(void) {
    if (!g_recorder_dict) return NULL; /* configure() not called: nothing to record into */
    PyObject* rec = PyDict_GetItemWithError(g_recorder_dict, s_active);
    if (!rec || rec == Py_None) return NULL;
    Py_INCREF(rec);
    PyObject* buf = NULL;
    PyObject* local = PyObject_GetAttr(rec, s_local);
    if (local) {
        buf = PyObject_GetAttr(local, s_buf);
        Py_DECREF(local);
    }
    if (!buf && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        buf = PyObject_CallMethodNoArgs(rec, s_buffer);
    }
    Py_DECREF(rec);
    return buf;
}

/* `__enter__`'s bookkeeping. 0, or -1 when an exception must propagate. Like the twin, a state
 * left from an earlier use is kept (with a new start time) when nothing is recorded this time. */
static int state_enter(span_state* s) {
    PyObject* buf = current_buffer();
    if (!buf) {
        if (PyErr_Occurred() && swallow("range enter") < 0) return -1;
        if (s->buf) s->start = now_ns();
        return 0;
    }
    PyObject *stack = NULL, *seq = NULL, *sid = NULL, *parent = NULL, *depth = NULL;
    Py_ssize_t n;
    stack = field_get(buf, F_STACK);
    if (!stack || next_id(buf, &seq, &sid) < 0 || field_set(buf, F_SEQ, seq) < 0) goto fail;
    n = PyObject_Length(stack);
    if (n < 0) goto fail;
    if (n > 0) {
        parent = PySequence_GetItem(stack, n - 1);
        if (!parent) goto fail;
    } else {
        parent = Py_NewRef(g_zero);
    }
    depth = PyLong_FromSsize_t(n);
    if (!depth) goto fail;
    if (append(stack, sid) < 0) goto fail;
    Py_DECREF(stack);
    Py_DECREF(seq);
    state_clear(s);
    s->buf = buf;
    s->sid = sid;
    s->parent = parent;
    s->depth = depth;
    s->start = now_ns();
    return 0;
fail:
    Py_XDECREF(stack);
    Py_XDECREF(seq);
    Py_XDECREF(sid);
    Py_XDECREF(parent);
    Py_XDECREF(depth);
    Py_DECREF(buf);
    if (swallow("range enter") < 0) return -1;
    if (s->buf) s->start = now_ns();
    return 0;
}

/* Removes sid from the stack: the top when it is there, else its first occurrence. */
static int stack_remove(PyObject* stack, PyObject* sid) {
    if (!PyList_CheckExact(stack)) { /* not a ThreadBuffer's own list: the twin's code, by name */
        Py_ssize_t n = PyObject_Length(stack);
        if (n < 0) return -1;
        if (n > 0) {
            PyObject* top = PySequence_GetItem(stack, n - 1);
            int eq = top ? PyObject_RichCompareBool(top, sid, Py_EQ) : -1;
            Py_XDECREF(top);
            if (eq < 0) return -1;
            if (eq) {
                PyObject* r = PyObject_CallMethod(stack, "pop", NULL);
                Py_XDECREF(r);
                return r ? 0 : -1;
            }
        }
        int c = PySequence_Contains(stack, sid);
        if (c <= 0) return c;
        PyObject* r = PyObject_CallMethod(stack, "remove", "O", sid);
        Py_XDECREF(r);
        return r ? 0 : -1;
    }
    Py_ssize_t n = PyList_GET_SIZE(stack);
    if (n == 0) return 0;
    int eq = PyObject_RichCompareBool(PyList_GET_ITEM(stack, n - 1), sid, Py_EQ);
    if (eq < 0) return -1;
    if (eq) return PyList_SetSlice(stack, n - 1, n, NULL);
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(stack); i++) {
        PyObject* item = PyList_GET_ITEM(stack, i);
        Py_INCREF(item);
        eq = PyObject_RichCompareBool(item, sid, Py_EQ);
        Py_DECREF(item);
        if (eq < 0) return -1;
        if (eq) return PyList_SetSlice(stack, i, i + 1, NULL);
    }
    return 0;
}

/*
 * A buffer over half full means its thread is outrunning the flusher, which needs the GIL to
 * empty it: every GIVE_WAY_MASK + 1 spans from then on (appended, or dropped once it is full: a
 * full buffer must not let the thread run faster still), the thread releases the GIL and yields
 * the CPU, so a flusher waiting for the GIL gets it at once instead of after the interpreter's
 * switch interval (5 ms, in which such a thread appends some 10,000 spans). Below half full (any
 * program but a flood of ranges) this never runs. The Python twin does the same.
 */
#define GIVE_WAY_MASK 1023
static unsigned long long g_gave_way; /* times, for tests (gave_way()) */
static void give_way(void) {
    g_gave_way++;
    Py_BEGIN_ALLOW_THREADS
    sched_yield();
    Py_END_ALLOW_THREADS
}

/* `__exit__`'s bookkeeping for a span of lane and category: consumes the state. 0, or -1 when an
 * exception must propagate. */
static int state_exit_as(span_state* s, PyObject* name, PyObject* attrs, PyObject* lane, PyObject* category) {
    int64_t end = now_ns();
    PyObject* buf = s->buf;
    if (!buf) return 0;
    PyObject *stack = NULL, *spans = NULL, *cap = NULL, *ev = NULL;
    stack = field_get(buf, F_STACK);
    if (!stack || stack_remove(stack, s->sid) < 0) goto fail;
    spans = field_get(buf, F_SPANS);
    if (!spans) goto fail;
    Py_ssize_t len = PyObject_Length(spans);
    if (len < 0) goto fail;
    cap = field_get(buf, F_CAPACITY);
    if (!cap) goto fail;
    int room;
    long long half = LLONG_MAX;
    if (PyLong_CheckExact(cap)) {
        int overflow = 0;
        long long c = PyLong_AsLongLongAndOverflow(cap, &overflow);
        if (c == -1 && PyErr_Occurred()) goto fail;
        room = overflow > 0 || (!overflow && (long long)len < c);
        if (!overflow) half = c / 2;
    } else {
        PyObject* l = PyLong_FromSsize_t(len);
        if (!l) goto fail;
        room = PyObject_RichCompareBool(l, cap, Py_LT);
        Py_DECREF(l);
        if (room < 0) goto fail;
    }
    if (room) {
        ev = PyTuple_New(SPAN_NFIELDS);
        if (!ev) goto fail;
        PyObject* start = PyLong_FromLongLong(s->start);
        PyObject* stop = start ? PyLong_FromLongLong(end) : NULL;
        if (!stop) {
            Py_XDECREF(start);
            goto fail;
        }
        PyTuple_SET_ITEM(ev, SPAN_ID, Py_NewRef(s->sid));
        PyTuple_SET_ITEM(ev, SPAN_PARENT_SPAN_ID, Py_NewRef(s->parent));
        PyTuple_SET_ITEM(ev, SPAN_LANE, Py_NewRef(lane));
        PyTuple_SET_ITEM(ev, SPAN_CATEGORY, Py_NewRef(category));
        PyTuple_SET_ITEM(ev, SPAN_NAME, Py_NewRef(name));
        PyTuple_SET_ITEM(ev, SPAN_START_NS, start);
        PyTuple_SET_ITEM(ev, SPAN_END_NS, stop);
        PyTuple_SET_ITEM(ev, SPAN_DEPTH, Py_NewRef(s->depth));
        PyTuple_SET_ITEM(ev, SPAN_ATTRS, Py_NewRef(attrs ? attrs : Py_None));
        /* What the collector would do at its first pass (_PyTuple_MaybeUntrack): a tuple of
         * ints, strings and None or an untracked (str-valued) dict can't be part of a cycle.
         * Buffers hold up to millions of these between flushes. */
        if (!attrs || attrs == Py_None || !PyObject_GC_IsTracked(attrs)) PyObject_GC_UnTrack(ev);
        if (append(spans, ev) < 0) goto fail;
        if ((long long)len > half && (len & GIVE_WAY_MASK) == 0) give_way();
    } else {
        PyObject* d = field_get(buf, F_DROPPED);
        PyObject* d1 = d ? PyNumber_Add(d, g_one) : NULL;
        Py_XDECREF(d);
        if (!d1) goto fail;
        long long dropped = PyLong_CheckExact(d1) ? PyLong_AsLongLong(d1) : -1;
        int r = field_set(buf, F_DROPPED, d1);
        Py_DECREF(d1);
        if (r < 0) goto fail;
        if (dropped > 0 && (dropped & GIVE_WAY_MASK) == 0) give_way(); /* full: the more so */
    }
    Py_DECREF(stack);
    Py_DECREF(spans);
    Py_DECREF(cap);
    Py_XDECREF(ev);
    return 0;
fail:
    Py_XDECREF(stack);
    Py_XDECREF(spans);
    Py_XDECREF(cap);
    Py_XDECREF(ev);
    return swallow("range exit");
}

/* A `gpu_trace.range` span: lane nvtx/gpu_trace, category nvtx (configure()). */
static int state_exit(span_state* s, PyObject* name, PyObject* attrs) {
    return state_exit_as(s, name, attrs, g_lane, g_category);
}

/* ---- attrs ---------------------------------------------------------------------------------- */

/* {str(k): str(v)} of the keyword arguments, or None when there are none. */
static PyObject* make_attrs(PyObject* const* values, PyObject* kwnames) {
    Py_ssize_t n = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (n == 0) return Py_NewRef(Py_None);
    PyObject* d = PyDict_New();
    if (!d) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject* k = PyObject_Str(PyTuple_GET_ITEM(kwnames, i));
        PyObject* v = k ? PyObject_Str(values[i]) : NULL;
        int r = v ? PyDict_SetItem(d, k, v) : -1;
        Py_XDECREF(k);
        Py_XDECREF(v);
        if (r < 0) {
            Py_DECREF(d);
            return NULL;
        }
    }
    return d;
}

static int check_name(PyObject* name) {
    if (PyUnicode_CheckExact(name)) return 0;
    PyErr_Format(PyExc_ValueError, "range name must be a string, got %s", Py_TYPE(name)->tp_name);
    return -1;
}

/* ---- the range type ------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject* name;
    PyObject* attrs; /* dict or None */
    span_state st;
} RangeObject;

static PyTypeObject RangeType;
static PyTypeObject WrapperType;

typedef struct {
    PyObject_HEAD
    PyObject* fn;
    PyObject* name;
    PyObject* attrs;
    PyObject* dict; /* __wrapped__, __name__, __doc__, ... from functools.update_wrapper */
    vectorcallfunc vectorcall;
} WrapperObject;

static PyObject* wrapper_alloc(PyTypeObject* type, Py_ssize_t n);

static RangeObject* range_alloc(PyTypeObject* type, PyObject* name, PyObject* attrs) {
    RangeObject* self = (RangeObject*)type->tp_alloc(type, 0);
    if (!self) return NULL;
    self->name = Py_NewRef(name);
    self->attrs = Py_NewRef(attrs);
    return self;
}

static PyObject* range_vectorcall(PyObject* type, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1) {
        PyErr_Format(PyExc_TypeError, "range() takes exactly one positional argument (%zd given)", nargs);
        return NULL;
    }
    if (check_name(args[0]) < 0) return NULL;
    PyObject* attrs = make_attrs(args + 1, kwnames);
    if (!attrs) return NULL;
    RangeObject* self = range_alloc((PyTypeObject*)type, args[0], attrs);
    Py_DECREF(attrs);
    return (PyObject*)self;
}

/* Subclasses are called through tp_new (a type's vectorcall is not inherited). */
static PyObject* range_new(PyTypeObject* type, PyObject* args, PyObject* kwargs) {
    if (PyTuple_GET_SIZE(args) != 1) {
        PyErr_Format(PyExc_TypeError, "range() takes exactly one positional argument (%zd given)",
                     PyTuple_GET_SIZE(args));
        return NULL;
    }
    PyObject* name = PyTuple_GET_ITEM(args, 0);
    if (check_name(name) < 0) return NULL;
    PyObject* attrs;
    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        attrs = PyDict_New();
        if (!attrs) return NULL;
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(kwargs, &pos, &k, &v)) {
            PyObject* ks = PyObject_Str(k);
            PyObject* vs = ks ? PyObject_Str(v) : NULL;
            int r = vs ? PyDict_SetItem(attrs, ks, vs) : -1;
            Py_XDECREF(ks);
            Py_XDECREF(vs);
            if (r < 0) {
                Py_DECREF(attrs);
                return NULL;
            }
        }
    } else {
        attrs = Py_NewRef(Py_None);
    }
    RangeObject* self = range_alloc(type, name, attrs);
    Py_DECREF(attrs);
    return (PyObject*)self;
}

static int range_traverse(RangeObject* self, visitproc visit, void* arg) {
    Py_VISIT(self->name);
    Py_VISIT(self->attrs);
    Py_VISIT(self->st.buf);
    return 0;
}

static int range_clear(RangeObject* self) {
    Py_CLEAR(self->name);
    Py_CLEAR(self->attrs);
    state_clear(&self->st);
    return 0;
}

static void range_dealloc(RangeObject* self) {
    PyObject_GC_UnTrack(self);
    range_clear(self);
    Py_TYPE(self)->tp_free((PyObject*)self);
}

static PyObject* range_enter(RangeObject* self, PyObject* unused) {
    (void)unused;
    if (state_enter(&self->st) < 0) return NULL;
    return Py_NewRef((PyObject*)self);
}

static PyObject* range_exit(RangeObject* self, PyObject* const* args, Py_ssize_t nargs) {
    (void)args;
    (void)nargs;
    if (!self->st.buf) Py_RETURN_NONE;
    /* The twin keeps its buffer after exit: a second exit records the span again. */
    span_state s = self->st;
    Py_INCREF(s.buf);
    Py_XINCREF(s.sid);
    Py_XINCREF(s.parent);
    Py_XINCREF(s.depth);
    int r = state_exit(&s, self->name, self->attrs);
    state_clear(&s);
    if (r < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject* range_call(RangeObject* self, PyObject* args, PyObject* kwargs) {
    PyObject* fn;
    if (kwargs && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "range() as a decorator takes the function only");
        return NULL;
    }
    if (!PyArg_UnpackTuple(args, "range", 1, 1, &fn)) return NULL;
    if (!g_update_wrapper) {
        PyErr_SetString(PyExc_RuntimeError, "gpu_trace.tracer._fastpath is not configured");
        return NULL;
    }
    WrapperObject* wo = (WrapperObject*)wrapper_alloc(&WrapperType, 0);
    if (!wo) return NULL;
    wo->fn = Py_NewRef(fn);
    wo->name = Py_NewRef(self->name);
    wo->attrs = Py_NewRef(self->attrs);
    PyObject* w = (PyObject*)wo;
    PyObject* r = PyObject_CallFunctionObjArgs(g_update_wrapper, w, fn, NULL);
    if (!r) {
        Py_DECREF(w);
        return NULL;
    }
    Py_DECREF(r);
    return w;
}

static PyMethodDef range_methods[] = {
    {"__enter__", (PyCFunction)range_enter, METH_NOARGS, NULL},
    {"__exit__", (PyCFunction)(void (*)(void))range_exit, METH_FASTCALL, NULL},
    {NULL},
};

static PyMemberDef range_members[] = {
    {"name", Py_T_OBJECT_EX, offsetof(RangeObject, name), READONLY, NULL},
    {"attrs", Py_T_OBJECT_EX, offsetof(RangeObject, attrs), READONLY, NULL},
    {NULL},
};

static PyTypeObject RangeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpu_trace.range",
    .tp_basicsize = sizeof(RangeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("A named range: ``with gpu_trace.range(\"load\", batch=3): ...`` or "
                        "``@gpu_trace.range(\"f\")``.\n\nRecorded on this thread's lane "
                        "``nvtx/gpu_trace`` with its attributes as strings, nested in the ranges "
                        "open around it. The C implementation; ``gpu_trace._api.PyRange`` is its "
                        "pure-Python twin."),
    .tp_new = range_new,
    .tp_vectorcall = range_vectorcall,
    .tp_dealloc = (destructor)range_dealloc,
    .tp_traverse = (traverseproc)range_traverse,
    .tp_clear = (inquiry)range_clear,
    .tp_call = (ternaryfunc)range_call,
    .tp_methods = range_methods,
    .tp_members = range_members,
};

/* ---- the decorator's wrapper ---------------------------------------------------------------- */

static PyObject* wrapper_vectorcall(WrapperObject* self, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
    span_state s = {0};
    if (state_enter(&s) < 0) return NULL;
    PyObject* result = PyObject_Vectorcall(self->fn, args, nargsf, kwnames);
    if (s.buf) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        int r = state_exit(&s, self->name, self->attrs);
        state_clear(&s);
        if (r < 0) {
            /* a BaseException while recording: it wins, as it would in a `finally` */
            Py_XDECREF(result);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return NULL;
        }
        PyErr_Restore(type, value, tb);
    }
    return result;
}

static PyObject* wrapper_descr_get(PyObject* self, PyObject* obj, PyObject* type) {
    (void)type;
    if (obj == NULL || obj == Py_None) return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

static PyObject* wrapper_reduce(WrapperObject* self, PyObject* unused) {
    (void)unused;
    /* Pickled by reference, like the function it wraps: the name of a module-level global. */
    return PyObject_GetAttr((PyObject*)self, s_qualname);
}

static PyObject* wrapper_repr(WrapperObject* self) {
    return PyUnicode_FromFormat("<gpu_trace.range %R wrapping %R>", self->name, self->fn);
}

static int wrapper_traverse(WrapperObject* self, visitproc visit, void* arg) {
    Py_VISIT(self->fn);
    Py_VISIT(self->name);
    Py_VISIT(self->attrs);
    Py_VISIT(self->dict);
    return 0;
}

static int wrapper_clear(WrapperObject* self) {
    Py_CLEAR(self->fn);
    Py_CLEAR(self->name);
    Py_CLEAR(self->attrs);
    Py_CLEAR(self->dict);
    return 0;
}

static void wrapper_dealloc(WrapperObject* self) {
    PyObject_GC_UnTrack(self);
    wrapper_clear(self);
    Py_TYPE(self)->tp_free((PyObject*)self);
}

static PyObject* wrapper_alloc(PyTypeObject* type, Py_ssize_t n) {
    PyObject* w = PyType_GenericAlloc(type, n);
    if (w) ((WrapperObject*)w)->vectorcall = (vectorcallfunc)wrapper_vectorcall;
    return w;
}

static PyMethodDef wrapper_methods[] = {
    {"__reduce__", (PyCFunction)wrapper_reduce, METH_NOARGS, NULL},
    {NULL},
};

static PyGetSetDef wrapper_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject WrapperType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "gpu_trace.tracer._fastpath._wrapper",
    .tp_basicsize = sizeof(WrapperObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_alloc = wrapper_alloc,
    .tp_dealloc = (destructor)wrapper_dealloc,
    .tp_traverse = (traverseproc)wrapper_traverse,
    .tp_clear = (inquiry)wrapper_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(WrapperObject, vectorcall),
    .tp_descr_get = wrapper_descr_get,
    .tp_dictoffset = offsetof(WrapperObject, dict),
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_methods = wrapper_methods,
    .tp_getset = wrapper_getset,
    .tp_repr = (reprfunc)wrapper_repr,
};

/* ---- span columns (the flusher's side) ------------------------------------------------------ */

/* Codes of one string column: `index` maps each distinct value to its code (first seen, first). */
static inline int encode(PyObject* index, PyObject* value, int32_t* code) {
    PyObject* c = PyDict_GetItemWithError(index, value); /* borrowed */
    if (c) {
        *code = (int32_t)PyLong_AsLong(c);
        return 0;
    }
    if (PyErr_Occurred()) return -1;
    Py_ssize_t n = PyDict_GET_SIZE(index);
    c = PyLong_FromSsize_t(n);
    if (!c) return -1;
    int rc = PyDict_SetItem(index, value, c);
    Py_DECREF(c);
    *code = (int32_t)n;
    return rc;
}

/*
 * span_columns(spans) -> (ints, lane_codes, lanes, category_codes, categories, name_codes, names, attrs)
 *
 * The flusher's transposition of span tuples into columns, in one pass: `ints` is bytes holding
 * five int64 columns of n values each (span_id, parent_span_id, start_ns, end_ns, depth; the ids
 * as their 64-bit patterns), each *_codes is bytes holding n int32 dictionary codes into the list
 * after it (values in order of first appearance), and `attrs` a list of the attrs values. It does
 * what gpu_trace.tracer.columns does in Python (a parity test holds them together), several
 * times faster: a thread emitting ranges as fast as it can must not outrun its flusher.
 */
static PyObject* span_columns(PyObject* module, PyObject* spans) {
    (void)module;
    if (!PyList_Check(spans)) {
        PyErr_SetString(PyExc_TypeError, "span_columns takes a list of span tuples");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(spans);
    PyObject* ints = PyBytes_FromStringAndSize(NULL, n * 5 * (Py_ssize_t)sizeof(int64_t));
    PyObject* codes[3] = {NULL, NULL, NULL};
    PyObject* index[3] = {NULL, NULL, NULL};
    PyObject* attrs = PyList_New(n);
    PyObject* result = NULL;
    if (!ints || !attrs) goto done;
    for (int k = 0; k < 3; k++) {
        codes[k] = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int32_t));
        index[k] = PyDict_New();
        if (!codes[k] || !index[k]) goto done;
    }
    int64_t* col = (int64_t*)PyBytes_AS_STRING(ints);
    int32_t* code[3];
    for (int k = 0; k < 3; k++) code[k] = (int32_t*)PyBytes_AS_STRING(codes[k]);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject* t = PyList_GET_ITEM(spans, i);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != SPAN_NFIELDS) {
            PyErr_Format(PyExc_ValueError, "span %zd is not a %d-tuple", i, SPAN_NFIELDS);
            goto done;
        }
        static const int int_fields[5] = {SPAN_ID, SPAN_PARENT_SPAN_ID, SPAN_START_NS, SPAN_END_NS, SPAN_DEPTH};
        for (int c = 0; c < 5; c++) {
            PyObject* v = PyTuple_GET_ITEM(t, int_fields[c]);
            int64_t x;
            if (c < 2) {
                unsigned long long u = PyLong_AsUnsignedLongLong(v);
                if (u == (unsigned long long)-1 && PyErr_Occurred()) goto done;
                x = (int64_t)u;
            } else {
                x = PyLong_AsLongLong(v);
                if (x == -1 && PyErr_Occurred()) goto done;
                if (c == 4 && (x < 0 || x > 65535)) {
                    PyErr_Format(PyExc_OverflowError, "span %zd: depth %lld out of range", i, (long long)x);
                    goto done;
                }
            }
            col[(Py_ssize_t)c * n + i] = x;
        }
        for (int k = 0; k < 3; k++)
            if (encode(index[k], PyTuple_GET_ITEM(t, SPAN_LANE + k), &code[k][i]) < 0) goto done;
        PyList_SET_ITEM(attrs, i, Py_NewRef(PyTuple_GET_ITEM(t, SPAN_ATTRS)));
    }
    PyObject* values[3] = {NULL, NULL, NULL};
    for (int k = 0; k < 3; k++) {
        values[k] = PyDict_Keys(index[k]); /* insertion order: the codes' order */
        if (!values[k]) {
            for (int j = 0; j < k; j++) Py_DECREF(values[j]);
            goto done;
        }
    }
    result = Py_BuildValue("(OOOOOOOO)", ints, codes[0], values[0], codes[1], values[1], codes[2], values[2],
                           attrs);
    for (int k = 0; k < 3; k++) Py_DECREF(values[k]);
done:
    Py_XDECREF(ints);
    Py_XDECREF(attrs);
    for (int k = 0; k < 3; k++) {
        Py_XDECREF(codes[k]);
        Py_XDECREF(index[k]);
    }
    return result;
}

/* ---- a call inside a range of any lane ------------------------------------------------------- */

/*
 * call_in_range(fn, lane, category, name, attrs, *args, **kwargs): fn(*args, **kwargs) inside a
 * range, recorded as a span of `lane` and `category` in the calling thread's buffer, nested in the
 * ranges open around it like `gpu_trace.range`'s, closed whether fn returns or raises. Why: the
 * PyTorch module patch wraps every nn.Module call; in Python, opening and closing its range cost
 * about as much as the rest of its wrapper (bench/module_level.py). framework_patches.spans'
 * begin/end is the Python twin (a parity test holds them together).
 */
static PyObject* call_in_range(PyObject* module, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
    (void)module;
    if (nargs < 5) {
        PyErr_SetString(PyExc_TypeError, "call_in_range(fn, lane, category, name, attrs, *args, **kwargs)");
        return NULL;
    }
    PyObject *fn = args[0], *lane = args[1], *category = args[2], *name = args[3], *attrs = args[4];
    span_state s = {0};
    if (state_enter(&s) < 0) return NULL;
    PyObject* result = PyObject_Vectorcall(fn, args + 5, (size_t)(nargs - 5), kwnames);
    if (s.buf) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        int r = state_exit_as(&s, name, attrs, lane, category);
        state_clear(&s);
        if (r < 0) {
            /* a BaseException while recording: it wins, as it would in a `finally` */
            Py_XDECREF(result);
            Py_XDECREF(type);
            Py_XDECREF(value);
            Py_XDECREF(tb);
            return NULL;
        }
        PyErr_Restore(type, value, tb);
    }
    return result;
}

/* ---- module --------------------------------------------------------------------------------- */

static PyObject* configure(PyObject* module, PyObject* args) {
    (void)module;
    PyObject *rec_mod, *buf_type, *lane, *category, *warn, *update_wrapper;
    if (!PyArg_ParseTuple(args, "OO!UUOO:configure", &rec_mod, &PyType_Type, &buf_type, &lane, &category, &warn,
                          &update_wrapper))
        return NULL;
    PyObject* d = PyModule_GetDict(rec_mod); /* borrowed */
    if (!d) return NULL;
    Py_ssize_t offs[F_COUNT];
    for (int f = 0; f < F_COUNT; f++) {
        offs[f] = 0;
        PyObject* desc = PyDict_GetItemString(((PyTypeObject*)buf_type)->tp_dict, g_field_names[f]);
        if (desc && Py_TYPE(desc) == &PyMemberDescr_Type) {
            PyMemberDef* m = ((PyMemberDescrObject*)desc)->d_member;
            if (m->type == Py_T_OBJECT_EX && !(m->flags & READONLY)) offs[f] = m->offset;
        }
    }
    Py_XSETREF(g_recorder_dict, Py_NewRef(d));
    Py_XSETREF(g_buffer_type, Py_NewRef(buf_type));
    Py_XSETREF(g_lane, Py_NewRef(lane));
    Py_XSETREF(g_category, Py_NewRef(category));
    Py_XSETREF(g_warn, Py_NewRef(warn));
    Py_XSETREF(g_update_wrapper, Py_NewRef(update_wrapper));
    memcpy(g_field_off, offs, sizeof(offs));
    Py_RETURN_NONE;
}

static PyObject* slot_offsets(PyObject* module, PyObject* unused) {
    (void)module;
    (void)unused;
    PyObject* d = PyDict_New();
    for (int f = 0; d && f < F_COUNT; f++) {
        PyObject* v = PyLong_FromSsize_t(g_field_off[f]);
        if (!v || PyDict_SetItemString(d, g_field_names[f], v) < 0) Py_CLEAR(d);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject* gave_way(PyObject* module, PyObject* unused) {
    (void)module;
    (void)unused;
    return PyLong_FromUnsignedLongLong(g_gave_way);
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_VARARGS,
     PyDoc_STR("configure(recorder_module, ThreadBuffer, lane, category, warn, update_wrapper)")},
    {"slot_offsets", slot_offsets, METH_NOARGS, PyDoc_STR("ThreadBuffer fields read by offset (0: by name)")},
    {"gave_way", gave_way, METH_NOARGS, PyDoc_STR("how many times a range has given the GIL way")},
    {"span_columns", span_columns, METH_O, PyDoc_STR("span tuples as columns (see gpu_trace.tracer.columns)")},
    {"call_in_range", (PyCFunction)(void (*)(void))call_in_range, METH_FASTCALL | METH_KEYWORDS,
     PyDoc_STR("call_in_range(fn, lane, category, name, attrs, *args, **kwargs): fn's result, "
               "called inside a range of that lane and category")},
    {NULL},
};

static struct PyModuleDef module_def = {
    .m_base = PyModuleDef_HEAD_INIT,
    .m_name = "_fastpath",
    .m_doc = "The C twin of gpu_trace.range.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__fastpath(void) {
    s_active = PyUnicode_InternFromString("active");
    s_local = PyUnicode_InternFromString("_local");
    s_buf = PyUnicode_InternFromString("buf");
    s_buffer = PyUnicode_InternFromString("buffer");
    s_qualname = PyUnicode_InternFromString("__qualname__");
    g_zero = PyLong_FromLong(0);
    g_one = PyLong_FromLong(1);
    if (!s_active || !s_local || !s_buf || !s_buffer || !s_qualname || !g_zero || !g_one)
        return NULL;
    for (int f = 0; f < F_COUNT; f++) {
        g_field_str[f] = PyUnicode_InternFromString(g_field_names[f]);
        if (!g_field_str[f]) return NULL;
    }
    if (PyType_Ready(&RangeType) < 0 || PyType_Ready(&WrapperType) < 0) return NULL;
    PyObject* m = PyModule_Create(&module_def);
    if (!m) return NULL;
    if (PyModule_AddObjectRef(m, "range", (PyObject*)&RangeType) < 0 ||
        PyModule_AddObjectRef(m, "_wrapper", (PyObject*)&WrapperType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
