/* Optional C fast paths for the per-call work of gluon_dynbatch.
 *
 * Recording runs once per block call (5,000+ per SICK minibatch of 256),
 * and planning and running a flush touch every node again; in Python that
 * was a third of a batched minibatch.  This module does the same work in
 * C (see accel.py for the Python side):
 *
 *   DynBatchBlock.__call__ (call_method) -> record without a Python frame
 *   record(scope, dblock, args)  -> BatchingScope.record; None: run Python's
 *   count_groups(nodes)          -> plan.count_groups_py
 *   depth_groups(nodes)          -> plan.depth_groups_py
 *   agenda_groups(nodes)         -> plan.agenda_groups_py
 *   Tape, structure_key(nodes)   -> plan.structure_key_py, as int32 words
 *                                   (a Tape writes them while recording)
 *   gather_index(leaves, ZeroRow)-> execute.collect for lazy values and NDArrays
 *   host_rows(leaves)            -> numpy leaves' bytes, concatenated
 *   host_item(nodes, span_of)    -> the same for one argument of every node
 *   finish_nodes(nodes, arrays)  -> execute.finish_nodes_py
 *   wrap_host(array)             -> mx.nd.from_numpy(array, zero_copy=True)
 *                                   (execute.to_device, threaded engines)
 *   push_marker, marker_done     -> whether the engine has run a pipelined
 *                                   scope's last part (no Python version)
 *
 * Each is an exact copy of the Python function named for the common case
 * only.  Whenever a call is unusual (nested lists, a failed producer, mixed
 * contexts, an unknown leaf type) record() returns None *before
 * changing anything*, and the caller runs the Python version, which also
 * raises the errors.  So errors and rare cases have one implementation.
 *
 * Node and LazyValue stay Python classes with __slots__; configure() reads
 * the offsets of their slots from the slot descriptors, and this module
 * reads and writes those slots directly, as the descriptors themselves do.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_pycompat.h"
#include <structmember.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <x86intrin.h>
#define HAVE_TSC 1
#endif

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

/* A node's argument leaves: a tuple where this recorder made the node (one
 * allocation, freed to the tuple free lists: recording a SICK minibatch of
 * 256 and dropping it cost 7% and 35% less than with a list), a list where
 * the Python one did.  Read either with CPython's PySequence_Fast_ macros. */
#define LEAVES_OK(leaves) (PyTuple_Check(leaves) || PyList_Check(leaves))
#if defined(__GNUC__) || defined(__clang__)
#define PREFETCH(address) __builtin_prefetch(address)
#else
#define PREFETCH(address) ((void)0)
#endif
#define MAX_INLINE_MARKS 64

static PyTypeObject *LazyValueType, *NodeType, *NDArrayType, *NumpyType;
static PyObject *current_context, *default_ctx_holder, *lazy_results_py, *zeros_fmt;
static PyObject *ctx_dict;      /* see default_context() */
static uint64_t ctx_dict_thread;
static int ctx_dict_usable;
static PyObject *pair_fmt, *int_zero, *int_one;

static Py_ssize_t lv_node, lv_index, lv_data;
static Py_ssize_t n_sig, n_leaves, n_depth, n_scope, n_pos, n_state, n_used, n_arrays, n_row;

static PyObject *s_out_info, *s_batch_safe, *s_group_key, *s_out_fmt,
    *s_signatures, *s_trace, *s_pending, *s_flush_at, *s_pipeline,
    *s_shape, *s_dtype, *s_type, *s_context, *s_device_typeid, *s_device_id, *s_sig_id,
    *s_arrays, *s_value, *s___dict__, *s_tape, *s_repeatable, *s_itemsize, *s_isnative,
    *s_passthrough, *s_grad, *s_inference;

enum { PENDING = 0, DONE = 1, FAILED = 2 };

/* The scopes' class and its ``failure`` slot (set by call_method) */
static PyTypeObject *ScopeType;
static Py_ssize_t sc_failure;

/* Whether a computed value of ``producer`` may not be read: its scope
 * failed when one of its values was read (``failure``, see
 * LazyValue.asnumpy), or is not a scope this module knows.  The call then
 * goes to Python, which raises the LazyValueError. */
static int producer_failed(PyObject *producer)
{
    PyObject *scope = SLOT(producer, n_scope);
    return Py_TYPE(scope) != ScopeType || SLOT(scope, sc_failure) != Py_None;
}

/* The node lazy value ``leaf`` reads, or NULL where it holds none: a
 * LazyValue made by hand (public, it can be), whose call goes to Python,
 * which raises.  Read before any slot of the producer (they were read at
 * a Node's offsets from whatever it held: a crash). */
static inline PyObject *lazy_producer(PyObject *leaf)
{
    PyObject *producer = SLOT(leaf, lv_node);
    return producer != NULL && Py_TYPE(producer) == NodeType ? producer : NULL;
}

static int configured = 0;
static int numpy_fields_read = 0;  /* see NumpyFields */

/* ---------------------------------------------------------------- set-up */

static int slot_offset(PyTypeObject *type, const char *name, Py_ssize_t *offset)
{
    PyObject *descr = PyDict_GetItemString(type->tp_dict, name);   /* borrowed */
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ member", type->tp_name, name);
        return -1;
    }
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    if (member->type != T_OBJECT_EX || (member->flags & READONLY)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot", type->tp_name, name);
        return -1;
    }
    *offset = member->offset;
    return 0;
}

static int probe_numpy_fields(PyObject *probe);

static PyObject *configure(PyObject *self, PyObject *args)
{
    PyObject *lazy, *node, *ndarray, *numpy_type, *probe;
    if (!PyArg_ParseTuple(args, "O!O!O!O!OOOO!O", &PyType_Type, &lazy, &PyType_Type, &node,
                          &PyType_Type, &ndarray, &PyType_Type, &numpy_type, &current_context,
                          &default_ctx_holder, &lazy_results_py, &PyTuple_Type, &zeros_fmt, &probe))
        return NULL;
    LazyValueType = (PyTypeObject *)lazy;
    NodeType = (PyTypeObject *)node;
    NDArrayType = (PyTypeObject *)ndarray;
    NumpyType = (PyTypeObject *)numpy_type;
    Py_INCREF(lazy); Py_INCREF(node); Py_INCREF(ndarray); Py_INCREF(numpy_type);
    Py_INCREF(current_context); Py_INCREF(default_ctx_holder);
    Py_INCREF(lazy_results_py); Py_INCREF(zeros_fmt);
    Py_CLEAR(ctx_dict);
    ctx_dict_usable = strcmp(Py_TYPE(default_ctx_holder)->tp_name, "_thread._local") == 0;
    if (slot_offset(LazyValueType, "_node", &lv_node)
        || slot_offset(LazyValueType, "_index", &lv_index)
        || slot_offset(LazyValueType, "_data", &lv_data)
        || slot_offset(NodeType, "sig", &n_sig) || slot_offset(NodeType, "leaves", &n_leaves)
        || slot_offset(NodeType, "depth", &n_depth) || slot_offset(NodeType, "scope", &n_scope)
        || slot_offset(NodeType, "pos", &n_pos) || slot_offset(NodeType, "state", &n_state)
        || slot_offset(NodeType, "used", &n_used) || slot_offset(NodeType, "arrays", &n_arrays)
        || slot_offset(NodeType, "row", &n_row))
        return NULL;
    numpy_fields_read = Py_TYPE(probe) == NumpyType && probe_numpy_fields(probe);
    configured = 1;
    return PyBool_FromLong(numpy_fields_read);
}

/* ------------------------------------------------------------- helpers */

static inline long small_int(PyObject *value)
{
    if (value != NULL && !PyLong_Check(value)) {   /* before 3.10 a float's int() was taken */
        PyErr_SetString(PyExc_TypeError, "an int was expected");
        return -1;
    }
    return value == NULL ? -1 : PyLong_AsLong(value);
}

static inline void set_slot(PyObject *obj, Py_ssize_t offset, PyObject *value)  /* steals */
{
    PyObject *old = SLOT(obj, offset);
    SLOT(obj, offset) = value;
    Py_XDECREF(old);
}

static inline double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Recording's clock, read twice a recorded call: the processor's time-stamp
 * counter where it ticks at a constant rate (the invariant TSC; ~8 ns a
 * read, against ~24 for clock_gettime, a tenth of a recorded call), else
 * clock_gettime in nanoseconds.  Ticks become seconds at the rate measured
 * since the module loaded (tick_seconds). */
static int use_tsc;
static uint64_t tsc_origin;
static double clock_origin;

static inline uint64_t ticks(void)
{
#ifdef HAVE_TSC
    if (use_tsc)
        return __rdtsc();
#endif
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ticks since ``start``; 0 if the counter went back (a TSC read on another
 * core or socket that is not in step, or after a suspend that reset it) */
static inline uint64_t ticks_since(uint64_t start)
{
    uint64_t end = ticks();
    return end > start ? end - start : 0;
}

static void start_ticks(void)
{
#ifdef HAVE_TSC
    unsigned int eax, ebx, ecx, edx;
    use_tsc = __get_cpuid(0x80000007, &eax, &ebx, &ecx, &edx) && (edx & (1u << 8));
#ifdef __linux__
    /* and only where Linux keeps time by it: the kernel checked that the
     * counters of all processors agree before choosing it */
    FILE *file = fopen("/sys/devices/system/clocksource/clocksource0/current_clocksource", "r");
    char name[16] = "";
    if (file != NULL) {
        if (fgets(name, sizeof name, file) == NULL)
            name[0] = 0;
        fclose(file);
    }
    use_tsc = use_tsc && strncmp(name, "tsc", 3) == 0 && (name[3] == '\n' || name[3] == 0);
#endif
#endif
    clock_origin = now();
    tsc_origin = ticks();
}

/* ``count`` ticks in seconds */
static double tick_seconds(uint64_t count)
{
    if (!use_tsc)
        return count * 1e-9;
    uint64_t elapsed = ticks_since(tsc_origin);
    double seconds = now() - clock_origin;
    return elapsed > 0 && seconds > 0 ? count * (seconds / elapsed) : 0.0;
}

/* An object's slot among 1 << bits, by a multiplicative hash of its
 * address: by the address's low bits, objects allocated a power of two
 * apart shared a slot, and each took it from the other at every call (two
 * signatures in sig_info, numpy's float64 and int32 in numpy_itemsize). */
static inline size_t address_slot(const void *address, int bits)
{
    return (size_t)((((uint64_t)(uintptr_t)address >> 4) * 0x9E3779B97F4A7C15ull)
                    >> (64 - bits));
}

/* What recording reads of a signature, kept for the signatures seen
 * lately (a cache of sets of SIG_WAYS entries): attribute lookups were a
 * fifth of a recorded call.  Signatures never change after
 * DynBatchBlock._trace returns, and only traced ones reach this cache.  An
 * entry holds its signature by a weak reference, so the cache keeps no
 * model alive (a dead signature's reference reads None, which no live
 * signature is). */
#define MAX_CLASSES 8          /* outputs with a leaf class (out_class) */

typedef struct {
    PyObject *ref, *family, *out_info, *out_fmt;
    long sig_id;
    /* per output (the first MAX_CLASSES) its leaf class (leaf_class), or
     * -1 where out_info is not a (shape, dtype, context) triple */
    int32_t out_class[MAX_CLASSES];
    Py_ssize_t n_classes;
    int safe;
    int repeatable;         /* TracedSignature.repeatable (absent: no) */
    int results;            /* what a call returns: RESULTS_ONE, RESULTS_PAIR, RESULTS_OTHER */
    PyObject *inference;    /* TracedSignature.inference by weak reference (the entry
                             * keeps no model alive), NULL where None */
} SigInfo;

/* A call's results (graph.lazy_results): one lazy value, a tuple of two,
 * or another nesting (built by Python) */
enum { RESULTS_ONE, RESULTS_PAIR, RESULTS_OTHER };

#define SIG_CACHE_BITS 10
#define SIG_CACHE (1 << SIG_CACHE_BITS)
#define SIG_WAYS_BITS 2
#define SIG_WAYS (1 << SIG_WAYS_BITS)
static SigInfo sig_cache[SIG_CACHE];
static unsigned char sig_victim[SIG_CACHE / SIG_WAYS];  /* per set, the entry to fill next */

static PyObject *context_key(PyObject *ctx);
static PyObject *leaf_classes;  /* (shape, dtype, context key) -> its number */

/* The number of what a signature's output ``info`` (out_info's (shape,
 * dtype, context)) gives a call's key for a lazy leaf, the same for every
 * output of every signature with an equal triple: the signature memo's
 * word for a lazy leaf, so calls given the outputs of different blocks of
 * one shape (an R-GCN's message blocks, one per edge type, in one list)
 * share memo entries, where words of each producer's signature multiplied
 * with the combinations.  Numbers are never reused (the dict keeps its
 * keys).  -1 for anything else, or on error (cleared). */
static int32_t leaf_class(PyObject *info)
{
    if (!PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 3)
        return -1;
    PyObject *ctx_key = context_key(PyTuple_GET_ITEM(info, 2));
    PyObject *key = ctx_key ? PyTuple_Pack(3, PyTuple_GET_ITEM(info, 0),
                                           PyTuple_GET_ITEM(info, 1), ctx_key) : NULL;
    Py_XDECREF(ctx_key);
    PyObject *number = key ? PyDict_GetItemWithError(leaf_classes, key) : NULL;
    long value = -1;
    if (number != NULL) {
        value = PyLong_AsLong(number);
    } else if (key != NULL && !PyErr_Occurred()
               && PyDict_GET_SIZE(leaf_classes) < INT32_MAX) {
        value = (long)PyDict_GET_SIZE(leaf_classes);
        PyObject *made = PyLong_FromLong(value);
        if (made == NULL || PyDict_SetItem(leaf_classes, key, made))
            value = -1;
        Py_XDECREF(made);
    }
    Py_XDECREF(key);
    PyErr_Clear();      /* (an unhashable shape: no class, so no memo) */
    return (int32_t)value;
}

static SigInfo *sig_info(PyObject *sig)
{
    /* SIG_WAYS entries a signature may take, a set found by address_slot:
     * with one entry found by the address's low bits, two signatures
     * allocated a power of two apart took it from each other at every call
     * (in some processes: the Tree-LSTM benchmark's quick mode missed
     * ~168,000 times in two of three, 634 in the third; now 11) */
    size_t set = address_slot(sig, SIG_CACHE_BITS - SIG_WAYS_BITS);
    SigInfo *info = &sig_cache[set << SIG_WAYS_BITS];
    for (int way = 0; way < SIG_WAYS; way++)
        if (info[way].ref != NULL && PyWeakref_GET_OBJECT(info[way].ref) == sig)
            return &info[way];
    /* Everything is read into locals first: reading runs Python code (an
     * allocation may start a collection, whose finalizers may let another
     * thread record), which must never find an entry that names this
     * signature but holds another's fields (its leaf classes then sent the
     * memo to a signature of another shape).  The entry is written at the
     * end, with no Python code between its fields, and what it held is
     * released after. */
    PyObject *flag = PyObject_GetAttr(sig, s_batch_safe);
    int safe = flag == NULL ? -1 : PyObject_IsTrue(flag);
    Py_XDECREF(flag);
    if (safe < 0)
        return NULL;
    PyObject *family = PyObject_GetAttr(sig, s_group_key);
    PyObject *out_info = family ? PyObject_GetAttr(sig, s_out_info) : NULL;
    PyObject *out_fmt = out_info ? PyObject_GetAttr(sig, s_out_fmt) : NULL;
    PyObject *id = out_fmt ? PyObject_GetAttr(sig, s_sig_id) : NULL;
    long sig_id = id ? PyLong_AsLong(id) : -1;
    Py_XDECREF(id);
    if (sig_id < 0 || sig_id > INT32_MAX) {
        Py_CLEAR(out_fmt);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "signature without a sig_id in int32");
    }
    if (out_fmt == NULL || !PyList_Check(out_info)) {
        Py_XDECREF(family); Py_XDECREF(out_info); Py_XDECREF(out_fmt);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "signature without an out_info list");
        return NULL;
    }
    int32_t out_class[MAX_CLASSES];
    Py_ssize_t n_classes = PyList_GET_SIZE(out_info) < MAX_CLASSES ? PyList_GET_SIZE(out_info)
                                                                   : MAX_CLASSES;
    for (Py_ssize_t i = 0; i < n_classes; i++) {
        /* (out_info holds the list's items: a list only grows or shrinks
         * by Python code, and leaf_class runs some) */
        PyObject *item = i < PyList_GET_SIZE(out_info) ? PyList_GET_ITEM(out_info, i) : NULL;
        out_class[i] = item ? leaf_class(item) : -1;
    }
    int pair = PyObject_RichCompareBool(out_fmt, pair_fmt, Py_EQ);
    int results = PyLong_CheckExact(out_fmt) && PyLong_AsLong(out_fmt) == 0 ? RESULTS_ONE
        : pair == 1 ? RESULTS_PAIR : RESULTS_OTHER;
    /* a call returning an argument unchanged returns that argument
     * (TracedSignature.passthrough): Python builds its results */
    PyObject *passthrough = PyObject_GetAttr(sig, s_passthrough);
    if (passthrough != NULL && PyObject_IsTrue(passthrough) == 1)
        results = RESULTS_OTHER;
    Py_XDECREF(passthrough);
    PyErr_Clear();
    PyObject *repeatable_flag = PyObject_GetAttr(sig, s_repeatable);
    int repeatable = repeatable_flag != NULL && PyObject_IsTrue(repeatable_flag) == 1;
    Py_XDECREF(repeatable_flag);
    PyErr_Clear();
    PyObject *inference = PyObject_GetAttr(sig, s_inference);
    if (inference == Py_None)
        Py_CLEAR(inference);
    PyErr_Clear();
    if (inference != NULL)      /* (the signature holds it: alive while it is) */
        Py_SETREF(inference, PyWeakref_NewRef(inference, NULL));
    PyObject *ref = inference != NULL || !PyErr_Occurred() ? PyWeakref_NewRef(sig, NULL) : NULL;
    if (ref == NULL) {
        Py_DECREF(family); Py_DECREF(out_info); Py_DECREF(out_fmt); Py_XDECREF(inference);
        return NULL;
    }
    /* the entry, written with no Python code in between; the victim is
     * chosen now (another thread may have filled the set meanwhile) */
    info += sig_victim[set]++ % SIG_WAYS;       /* the set's entries in turn */
    PyObject *old[5] = {info->ref, info->family, info->out_info, info->out_fmt,
                        info->inference};
    info->ref = ref;
    info->family = family;
    info->out_info = out_info;
    info->out_fmt = out_fmt;
    info->inference = inference;
    info->safe = safe;
    info->sig_id = sig_id;
    info->n_classes = n_classes;
    memcpy(info->out_class, out_class, sizeof(int32_t) * n_classes);
    info->results = results;
    info->repeatable = repeatable;
    /* released now: a dealloc may run Python code, which may take this
     * entry; then the caller (which reads it at once, before any Python
     * code) would read another signature's fields, so it is looked up again */
    int released = 0;
    for (int i = 0; i < 5; i++) {
        if (old[i] != NULL) {
            released = 1;
            Py_DECREF(old[i]);
        }
    }
    if (released && (info->ref == NULL || PyWeakref_GET_OBJECT(info->ref) != sig))
        return sig_info(sig);
    return info;
}

/* _mark_used of block.py, but only the flag: the C path counts groups at
 * the flush (count_groups), not per call */
static void mark_used(PyObject *node)
{
    if (SLOT(node, n_used) != Py_True) {
        Py_INCREF(Py_True);
        set_slot(node, n_used, Py_True);
    }
}

static PyObject *new_lazy(PyObject *node, PyObject *index)
{
    PyObject *value = LazyValueType->tp_alloc(LazyValueType, 0);
    if (value == NULL)
        return NULL;
    Py_INCREF(node); SLOT(value, lv_node) = node;
    Py_INCREF(index); SLOT(value, lv_index) = index;
    Py_INCREF(Py_None); SLOT(value, lv_data) = Py_None;
    return value;
}

/* ctx_dict: the calling thread's ``__dict__`` of Context._default_ctx (a
 * threading.local), remembered for the last thread that asked: reading
 * ``value`` from it is a dict lookup, where the attribute costs finding
 * the thread's dict first (~2% of recording a SICK minibatch).  A thread
 * is known by its thread state's id, never reused (unlike its ident);
 * ``with ctx:`` sets ``value`` in this very dict, which a thread keeps for
 * its life.  Only for CPython's own ``_thread._local`` (ctx_dict_usable,
 * set by configure): a greenlet-local one (gevent's monkey-patching) has
 * a dict per greenlet, and greenlets share their thread's state. */

/* mx.current_context(): the thread's Context._default_ctx.value, read
 * directly (a Python call costs more than the rest of a leaf's recording) */
static PyObject *default_context(void)
{
    if (!ctx_dict_usable)
        goto attribute;
    uint64_t thread = PyThreadState_GetID(PyThreadState_Get());
    if (ctx_dict == NULL || ctx_dict_thread != thread) {
        PyObject *dict = PyObject_GetAttr(default_ctx_holder, s___dict__);
        if (dict == NULL || !PyDict_CheckExact(dict)) {
            Py_XDECREF(dict);
            PyErr_Clear();
            goto attribute;
        }
        Py_XSETREF(ctx_dict, dict);
        ctx_dict_thread = thread;
    }
    PyObject *ctx = PyDict_GetItemWithError(ctx_dict, s_value);
    if (ctx != NULL)
        return Py_NewRef(ctx);
    if (PyErr_Occurred())
        return NULL;
attribute:;
    ctx = PyObject_GetAttr(default_ctx_holder, s_value);
    if (ctx == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
        PyErr_Clear();
        ctx = PyObject_CallNoArgs(current_context);
    }
    return ctx;
}

/* (ctx.device_typeid, ctx.device_id), remembered for the last context seen
 * (one or two Context objects serve a whole flush) */
static PyObject *last_ctx, *last_ctx_key;

static PyObject *context_key(PyObject *ctx)
{
    if (ctx != last_ctx) {
        PyObject *typeid = PyObject_GetAttr(ctx, s_device_typeid);
        PyObject *devid = typeid ? PyObject_GetAttr(ctx, s_device_id) : NULL;
        PyObject *ctx_key = devid ? PyTuple_Pack(2, typeid, devid) : NULL;
        Py_XDECREF(typeid);
        Py_XDECREF(devid);
        if (ctx_key == NULL)
            return NULL;
        Py_INCREF(ctx);
        Py_XSETREF(last_ctx, ctx);
        Py_XSETREF(last_ctx_key, ctx_key);
    }
    Py_INCREF(last_ctx_key);
    return last_ctx_key;
}

/* --------------------------------------------------------------- Tape */

/* The structure of a flush (plan.structure_key_py) as int32 words: per
 * node its signature's id, then per leaf the position of the pending node
 * it reads and which output (two words; -1 for a node of an earlier
 * flush), or HOST_WORD for host data and ARRAY_WORD for another array
 * (one word).  A signature fixes its number of leaves, so words read back
 * one way only: equal words, equal structure.  The same flush as a tuple
 * of 28,000 Python ints took ~1.3 ms to build and ~0.5 ms to hash and
 * compare at SICK minibatch 256; as bytes it hashes in ~0.05 ms. */
#define HOST_WORD (-2)
#define ARRAY_WORD (-3)

typedef struct {
    int32_t *data;
    Py_ssize_t len, cap;
    int broken;             /* a word did not fit, or memory ran out */
} Words;

static inline void push_word(Words *w, long value)
{
    if (w->len == w->cap) {
        Py_ssize_t cap = w->cap ? 2 * w->cap : 1024;
        int32_t *data = PyMem_Realloc(w->data, cap * sizeof(int32_t));
        if (data == NULL) { w->broken = 1; return; }
        w->data = data;
        w->cap = cap;
    }
    if (value < INT32_MIN || value > INT32_MAX) w->broken = 1;
    w->data[w->len++] = (int32_t)value;
}

/* the words of one node: its signature's id and its leaves */
static void push_node(Words *w, long sig_id, PyObject *leaves)
{
    push_word(w, sig_id);
    PyObject **items = PySequence_Fast_ITEMS(leaves);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(leaves);
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *leaf = items[j];
        if (Py_TYPE(leaf) == LazyValueType) {
            PyObject *producer = SLOT(leaf, lv_node);
            push_word(w, small_int(SLOT(producer, n_state)) == PENDING ?
                         PyLong_AsLong(SLOT(producer, n_pos)) : -1);
            push_word(w, PyLong_AsLong(SLOT(leaf, lv_index)));
        } else {
            push_word(w, Py_TYPE(leaf) == NumpyType ? HOST_WORD : ARRAY_WORD);
        }
    }
    if (PyErr_Occurred()) { PyErr_Clear(); w->broken = 1; }
}

/* The words so far as bytes (None if broken); empties ``w``. */
static PyObject *take_words(Words *w)
{
    PyObject *out = w->broken ? Py_NewRef(Py_None)
        : PyBytes_FromStringAndSize((const char *)w->data, w->len * sizeof(int32_t));
    w->len = 0;
    w->broken = 0;
    return out;
}

/* A scope's tape (BatchingScope.tape): the structure's words, written by
 * record() and, for the calls it defers, by BatchingScope.record through
 * add(); and the seconds spent recording, summed without a Python float
 * per call. */
typedef struct {
    PyObject_HEAD
    Words words;
    Py_ssize_t nodes;
    uint64_t ticks;         /* spent recording (see ticks()) */
} TapeObject;

static PyTypeObject TapeType;

static void tape_dealloc(TapeObject *tape)
{
    PyMem_Free(tape->words.data);
    Py_TYPE(tape)->tp_free((PyObject *)tape);
}

static PyObject *tape_add(TapeObject *tape, PyObject *node)
{
    if (!configured || Py_TYPE(node) != NodeType || !LEAVES_OK(SLOT(node, n_leaves))) {
        PyErr_SetString(PyExc_TypeError, "Tape.add(a recorded Node)");
        return NULL;
    }
    PyObject *id = PyObject_GetAttr(SLOT(node, n_sig), s_sig_id);
    if (id == NULL) return NULL;
    long sig_id = PyLong_AsLong(id);
    Py_DECREF(id);
    if (sig_id == -1 && PyErr_Occurred()) return NULL;
    push_node(&tape->words, sig_id, SLOT(node, n_leaves));
    tape->nodes++;
    Py_RETURN_NONE;
}

static PyObject *tape_take(TapeObject *tape, PyObject *unused)
{
    PyObject *words = take_words(&tape->words);
    PyObject *out = words ? Py_BuildValue("(Ndn)", words, tick_seconds(tape->ticks),
                                          tape->nodes) : NULL;
    tape->ticks = 0;
    tape->nodes = 0;
    return out;
}

static PyMethodDef tape_methods[] = {
    {"add", (PyCFunction)tape_add, METH_O, "add(node): append a node recorded in Python"},
    {"take", (PyCFunction)tape_take, METH_NOARGS,
     "take() -> (structure key: bytes, or None if it could not be written; seconds spent "
     "recording; nodes), and start again"},
    {NULL, NULL, 0, NULL}
};

static PyTypeObject TapeType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gluon_dynbatch._speedups.Tape",
    .tp_basicsize = sizeof(TapeObject),
    .tp_dealloc = (destructor)tape_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "What a scope records beside its nodes: the structure key, and the time spent.",
    .tp_methods = tape_methods,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------- signature memo */

/* Finding a call's signature through DynBatchBlock._signatures means
 * building its key (a tuple of the argument format, every leaf's shape,
 * the dtype and the context) and hashing and comparing it: a fifth of a
 * recorded call.  The memo finds it from words read straight off the
 * arguments instead: per list argument its length, per lazy leaf the
 * class of its producer's output (leaf_class: its shape, dtype and
 * context as a number never reused), per
 * numpy leaf its shape and dtype object, per NDArray leaf read through
 * MXNet's C API (ndarray_words) its dtype id, device and shape, and the
 * default context when no leaf names one.  Equal words give an equal key,
 * so the memo maps them to the signature the key found.  Entries hold the
 * block and the signature by weak references (the memo keeps no model
 * alive; a dead one's entry reads None and misses) and the dtype objects
 * they name by strong ones, so no address in an entry's words is reused
 * while the entry lives.  Words take one of a set of MEMO_WAYS entries: of
 * 256 entries each words could take only one, and the calls of bench_graph's
 * R-GCN missed in 0.2-10% of calls, by the process (the words hold
 * addresses), where now only their first calls miss. */
#define MEMO_SIZE 1024
#define MEMO_WAYS 4             /* the entries words may take (a set), filled in turn */
#define MEMO_WORDS 48
#define NUMPY_WORD (-1)
#define CONTEXT_WORD (-2)
#define LIST_WORD (-3)          /* minus the list's length */
#define NDARRAY_WORD (-1000)    /* below any LIST_WORD (a list takes at most MEMO_WORDS) */

/* A numpy array's fields as numpy's own C macros read them (the start of
 * PyArrayObject_fields, fixed because compiled extensions read it); read
 * here only if configure() found a probe array's shape and dtype there. */
typedef struct {
    PyObject_HEAD
    char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} NumpyFields;

#define NUMPY_C_CONTIGUOUS 0x1

typedef struct {
    uint64_t hash;
    PyObject *block_ref, *sig_ref, *dtypes;
    Py_ssize_t n;
    int64_t words[MEMO_WORDS];
} MemoEntry;

static MemoEntry memo[MEMO_SIZE];
static unsigned char memo_victim[MEMO_SIZE / MEMO_WAYS];     /* per set, the entry to fill next */

typedef struct {
    int64_t words[MEMO_WORDS];
    PyObject *dtypes[MEMO_WORDS];       /* borrowed: the leaves hold them */
    PyObject *leaves[MEMO_WORDS];       /* held until record_args returns (a collection
                                         * during it could free an argument's leaves) */
    Py_ssize_t n, n_dtypes, n_leaves;
    int lazy;
    int arrays;                         /* an NDArray leaf: its words hold the context */
} CallWords;

static int ndarray_words(CallWords *cw, PyObject *leaf);

static inline int push_call_word(CallWords *cw, int64_t value)
{
    if (cw->n == MEMO_WORDS) return 0;
    cw->words[cw->n++] = value;
    return 1;
}

/* Add ``leaf`` to ``cw``'s leaves and its words to ``cw``, updating the
 * call's depth and the producers to mark used as record_args does; 1 if
 * done, 0 if the call is not one for the memo (a pending value of another
 * scope among them: record_args then defers to Python, which refuses it),
 * -1 on error. */
/* Whether lazy value ``leaf``'s ``.data`` was read and then marked with
 * ``attach_grad()``: per sample that array is a leaf of its own, so a call
 * given the value must read it, not the step's rows (the Python recorder
 * does; BatchingScope.record).  One attribute read where ``.data`` was
 * read, none otherwise. */
static int data_marked(PyObject *leaf)
{
    PyObject *data = SLOT(leaf, lv_data);
    if (data == Py_None) return 0;
    if (data == NULL) return 1;         /* unset (a LazyValue made by hand): Python raises */
    PyObject *grad = PyObject_GetAttr(data, s_grad);
    if (grad == NULL) { PyErr_Clear(); return 1; }     /* Python decides */
    int marked = grad != Py_None;
    Py_DECREF(grad);
    return marked;
}

static int leaf_words(CallWords *cw, PyObject *leaf, long *depth, PyObject **marks,
                      Py_ssize_t *n_marks, PyObject *scope)
{
    cw->leaves[cw->n_leaves++] = Py_NewRef(leaf);  /* released by record_args */
    if (Py_TYPE(leaf) == LazyValueType) {
        PyObject *producer = lazy_producer(leaf);
        if (producer == NULL) return 0;
        long state = small_int(SLOT(producer, n_state));
        if (state == PENDING && SLOT(producer, n_scope) != scope)
            return 0;
        if (state == DONE && producer_failed(producer))
            return 0;
        if (data_marked(leaf))
            return 0;
        SigInfo *info = state == PENDING || state == DONE ? sig_info(SLOT(producer, n_sig)) : NULL;
        long index = info ? PyLong_AsLong(SLOT(leaf, lv_index)) : -1;
        if (index < 0 || index >= info->n_classes || info->out_class[index] < 0
            || !push_call_word(cw, info->out_class[index])) {
            PyErr_Clear();
            return 0;
        }
        cw->lazy = 1;
        if (state == PENDING) {
            long d = small_int(SLOT(producer, n_depth));
            if (d >= *depth) *depth = d + 1;
            if (SLOT(producer, n_used) != Py_True)
                marks[(*n_marks)++] = producer;
        }
        return 1;
    }
    if (Py_TYPE(leaf) != NumpyType) return ndarray_words(cw, leaf);
    if (numpy_fields_read) {
        const NumpyFields *array = (const NumpyFields *)leaf;
        int ok = push_call_word(cw, NUMPY_WORD) && push_call_word(cw, array->nd);
        for (int i = 0; ok && i < array->nd; i++)
            ok = push_call_word(cw, array->dimensions[i]);
        ok = ok && push_call_word(cw, (int64_t)(intptr_t)array->descr);
        if (ok) cw->dtypes[cw->n_dtypes++] = array->descr;
        return ok;
    }
    PyObject *shape = PyObject_GetAttr(leaf, s_shape);
    PyObject *descr = shape ? PyObject_GetAttr(leaf, s_dtype) : NULL;
    int ok = descr != NULL && PyTuple_Check(shape) && push_call_word(cw, NUMPY_WORD)
        && push_call_word(cw, PyTuple_GET_SIZE(shape));
    for (Py_ssize_t i = 0; ok && i < PyTuple_GET_SIZE(shape); i++)
        ok = push_call_word(cw, PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i)));
    ok = ok && !PyErr_Occurred() && push_call_word(cw, (int64_t)(intptr_t)descr);
    if (ok) cw->dtypes[cw->n_dtypes++] = descr;
    Py_XDECREF(shape);
    Py_XDECREF(descr);      /* the array keeps its dtype alive */
    PyErr_Clear();
    return ok;
}

/* Flatten ``args`` into ``cw->leaves`` (no list is made for a call that
 * merges with an earlier one) and their words into ``cw`` (and the depth
 * and marks, as leaf_words); 1, 0 or -1 as leaf_words. */
static int call_words(CallWords *cw, PyObject *const *args, Py_ssize_t nargs,
                      long *depth, PyObject **marks, Py_ssize_t *n_marks, PyObject *scope)
{
    Py_ssize_t count = 0;
    for (Py_ssize_t i = 0; i < nargs; i++)
        count += PyList_CheckExact(args[i]) || PyTuple_CheckExact(args[i]) ?
            PySequence_Fast_GET_SIZE(args[i]) : 1;
    cw->n = cw->n_dtypes = cw->n_leaves = 0;
    if (count > MEMO_WORDS) return 0;       /* (each leaf takes a word or more) */
    cw->lazy = cw->arrays = 0;
    if (!push_call_word(cw, nargs)) return 0;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        PyObject *arg = args[i];
        int rc;
        if (PyList_CheckExact(arg) || PyTuple_CheckExact(arg)) {
            Py_ssize_t len = PySequence_Fast_GET_SIZE(arg);
            if (!push_call_word(cw, LIST_WORD - len)) return 0;
            for (Py_ssize_t j = 0; j < len; j++) {
                /* leaf_words may allocate, and a collection run Python code
                 * that changes the list: re-read it, give up if resized */
                if (PySequence_Fast_GET_SIZE(arg) != len) return 0;
                if ((rc = leaf_words(cw, PySequence_Fast_ITEMS(arg)[j], depth, marks, n_marks,
                                     scope)) != 1)
                    return rc;
            }
        } else if ((rc = leaf_words(cw, arg, depth, marks, n_marks, scope)) != 1) {
            return rc;
        }
    }
    if (!cw->lazy && !cw->arrays) {     /* host arrays only: the default context */
        PyObject *ctx = default_context();
        PyObject *ctx_key = ctx ? context_key(ctx) : NULL;
        Py_XDECREF(ctx);
        if (ctx_key == NULL) {
            if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_Exception))
                return -1;              /* an interrupt: now */
            PyErr_Clear();
            return 0;
        }
        int ok = push_call_word(cw, CONTEXT_WORD)
            && push_call_word(cw, PyLong_AsLongLong(PyTuple_GET_ITEM(ctx_key, 0)))
            && push_call_word(cw, PyLong_AsLongLong(PyTuple_GET_ITEM(ctx_key, 1)));
        Py_DECREF(ctx_key);
        if (!ok || PyErr_Occurred()) { PyErr_Clear(); return 0; }
    }
    return 1;
}

static uint64_t call_hash(const CallWords *cw, PyObject *dblock)
{
    uint64_t h = (uint64_t)(uintptr_t)dblock * 0x9E3779B97F4A7C15ull;
    for (Py_ssize_t i = 0; i < cw->n; i++)
        h = (h ^ (uint64_t)cw->words[i]) * 0x100000001B3ull;
    return h ^ (h >> 31);
}

/* The signature memoized for these words (borrowed), or NULL. */
static PyObject *memo_get(PyObject *dblock, const CallWords *cw, uint64_t hash)
{
    MemoEntry *e = &memo[(hash % (MEMO_SIZE / MEMO_WAYS)) * MEMO_WAYS];
    for (int way = 0; way < MEMO_WAYS; way++, e++) {
        if (e->sig_ref == NULL || e->hash != hash || e->n != cw->n
            || memcmp(e->words, cw->words, cw->n * sizeof(int64_t))
            || PyWeakref_GET_OBJECT(e->block_ref) != dblock)
            continue;
        PyObject *sig = PyWeakref_GET_OBJECT(e->sig_ref);
        if (sig != Py_None)
            return sig;     /* (a dead one's words may be memoized again in another way) */
    }
    return NULL;
}

static void memo_put(PyObject *dblock, const CallWords *cw, uint64_t hash, PyObject *sig)
{
    PyObject *block_ref = PyWeakref_NewRef(dblock, NULL);
    PyObject *sig_ref = block_ref ? PyWeakref_NewRef(sig, NULL) : NULL;
    PyObject *dtypes = sig_ref ? PyTuple_New(cw->n_dtypes) : NULL;
    if (dtypes == NULL) {               /* not weak-referenceable: no memo */
        Py_XDECREF(block_ref); Py_XDECREF(sig_ref);
        PyErr_Clear();
        return;
    }
    for (Py_ssize_t i = 0; i < cw->n_dtypes; i++)
        PyTuple_SET_ITEM(dtypes, i, Py_NewRef(cw->dtypes[i]));
    size_t set = hash % (MEMO_SIZE / MEMO_WAYS);
    MemoEntry *e = &memo[set * MEMO_WAYS + memo_victim[set]++ % MEMO_WAYS];
    e->hash = hash;
    e->n = cw->n;
    memcpy(e->words, cw->words, cw->n * sizeof(int64_t));
    Py_XSETREF(e->block_ref, block_ref);
    Py_XSETREF(e->sig_ref, sig_ref);
    Py_XSETREF(e->dtypes, dtypes);
}

/* memo_clear(): forget every memoized signature.  A block whose traces
 * are dropped (its child blocks were replaced, DynBatchBlock's
 * _forget_traces) traces again, while the memo, whose key is only what the
 * arguments say, would still find its old signatures alive. */
static PyObject *memo_clear(PyObject *self, PyObject *unused)
{
    for (int i = 0; i < MEMO_SIZE; i++) {
        MemoEntry *e = &memo[i];
        Py_CLEAR(e->block_ref);
        Py_CLEAR(e->sig_ref);
        Py_CLEAR(e->dtypes);
        e->hash = 0;
        e->n = 0;
    }
    Py_RETURN_NONE;
}

/* Whether ``probe`` (numpy.empty((2, 3, 5))) has its shape and dtype where
 * NumpyFields says. */
static int probe_numpy_fields(PyObject *probe)
{
    const NumpyFields *array = (const NumpyFields *)probe;
    if ((size_t)Py_TYPE(probe)->tp_basicsize < sizeof(NumpyFields))
        return 0;
    PyObject *descr = PyObject_GetAttr(probe, s_dtype);
    Py_XDECREF(descr);              /* only its address is compared */
    int ok = descr != NULL && array->descr == descr && array->nd == 3
        && array->dimensions[0] == 2 && array->dimensions[1] == 3 && array->dimensions[2] == 5
        && (array->flags & NUMPY_C_CONTIGUOUS);
    /* and its transpose, a view, is not C-contiguous */
    PyObject *view = ok ? PyObject_GetAttrString(probe, "T") : NULL;
    ok = view != NULL && Py_TYPE(view) == Py_TYPE(probe)
        && ((const NumpyFields *)view)->nd == 3 && ((const NumpyFields *)view)->dimensions[0] == 5
        && !(((const NumpyFields *)view)->flags & NUMPY_C_CONTIGUOUS);
    Py_XDECREF(view);
    PyErr_Clear();
    return ok;
}

/* ------------------------------------------------------------- record */

/* Flatten ``args`` (a tuple) into ``leaves``; the nesting format, or NULL
 * with no error for anything but leaves and flat lists/tuples. */
static PyObject *flatten_flat(PyObject *const *args, Py_ssize_t n, PyObject *leaves)
{
    PyObject *fmt = PyTuple_New(n);
    if (fmt == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *arg = args[i];
        PyObject *item;
        if (PyList_CheckExact(arg) || PyTuple_CheckExact(arg)) {
            Py_ssize_t len = PySequence_Fast_GET_SIZE(arg);
            PyObject **elems = PySequence_Fast_ITEMS(arg);
            for (Py_ssize_t j = 0; j < len; j++) {
                if (PyList_Check(elems[j]) || PyTuple_Check(elems[j]) ||
                    PyList_Append(leaves, elems[j])) {
                    Py_DECREF(fmt);
                    return NULL;            /* nested: the Python path */
                }
            }
            if (len < PyTuple_GET_SIZE(zeros_fmt)) {
                item = PyTuple_GET_ITEM(zeros_fmt, len);
                Py_INCREF(item);
            } else {
                item = PyTuple_New(len);
                if (item == NULL) { Py_DECREF(fmt); return NULL; }
                for (Py_ssize_t j = 0; j < len; j++) {
                    Py_INCREF(int_zero);
                    PyTuple_SET_ITEM(item, j, int_zero);
                }
            }
        } else if (PyList_Check(arg) || PyTuple_Check(arg)) {
            Py_DECREF(fmt);
            return NULL;                    /* a list subclass: the Python path */
        } else {
            if (PyList_Append(leaves, arg)) { Py_DECREF(fmt); return NULL; }
            item = int_zero;
            Py_INCREF(item);
        }
        PyTuple_SET_ITEM(fmt, i, item);
    }
    return fmt;
}

/* A field of the scope (a new reference): straight from its slot when it
 * is a BatchingScope (see call_method), else by attribute; NULL with an
 * exception set when unset. */
static Py_ssize_t sc_tape, sc_pending, sc_flush_at, sc_mode, sc_repeats, sc_repeated;

/* MXNet's MXAutogradIsRecording and MXAutogradIsTraining (set_autograd_state) */
typedef int (*AutogradFlag)(bool *);
static AutogradFlag is_recording_fn, is_training_fn;

#ifndef _WIN32
#include <dlfcn.h>
/* MXNet's own thread-local flags, mxnet::Imperative::is_recording_ and
 * is_train_ (set_autograd_flags), read in place: the two C API calls that
 * return them cost ~35 ns a recorded call (~12% of recording a SICK
 * minibatch), mostly MXNet's per-call API bookkeeping.  dlsym gives a
 * thread-local symbol's address for the calling thread, so each thread
 * looks its flags up once, and reads them in place only if they follow
 * MXNet's setters in all four states (else, or where the symbols are not
 * exported, it asks the API as before).  flags_generation renews each
 * thread's look-up after set_autograd_flags. */
typedef int (*AutogradSetFlag)(int, int *);
static AutogradSetFlag set_recording_fn, set_training_fn;
static void *mxnet_handle;
static long flags_generation = 1;
static _Thread_local const volatile bool *flag_recording, *flag_training;
static _Thread_local long flags_checked;    /* flags_generation when looked up, negated
                                             * if they are not to be read in place */

/* The flags' state through the API, and both ways: 0 if they agree. */
static int flags_disagree(void)
{
    bool recording, training;
    if (is_recording_fn(&recording) || is_training_fn(&training)) return 1;
    return *flag_recording != recording || *flag_training != training;
}

static int look_up_flags(void)
{
    flag_recording = flag_training = NULL;
    if (mxnet_handle == NULL || is_recording_fn == NULL || is_training_fn == NULL
        || set_recording_fn == NULL || set_training_fn == NULL)
        return 0;
    flag_recording = dlsym(mxnet_handle, "_ZN5mxnet10Imperative13is_recording_E");
    flag_training = dlsym(mxnet_handle, "_ZN5mxnet10Imperative9is_train_E");
    if (flag_recording == NULL || flag_training == NULL) return 0;
    bool recording, training;
    if (is_recording_fn(&recording) || is_training_fn(&training)) return 0;
    int ok = !flags_disagree(), prev;
    for (int state = 1; ok && state < 4; state++) {     /* flip each, then both */
        int r = state & 1 ? !recording : recording, t = state & 2 ? !training : training;
        ok = set_recording_fn(r, &prev) == 0 && set_training_fn(t, &prev) == 0
            && !flags_disagree();
    }
    set_recording_fn(recording, &prev);                 /* and back */
    set_training_fn(training, &prev);
    ok = ok && !flags_disagree();
    return ok;
}
#endif

/* MXNet's autograd flags of the calling thread; 0, or -1 if unknown. */
static int autograd_flags(bool *recording, bool *training)
{
#ifndef _WIN32
    if (flags_checked != flags_generation && flags_checked != -flags_generation)
        flags_checked = look_up_flags() ? flags_generation : -flags_generation;
    if (flags_checked > 0) {
        *recording = *flag_recording;
        *training = *flag_training;
        return 0;
    }
#endif
    if (is_recording_fn == NULL || is_training_fn == NULL
        || is_recording_fn(recording) != 0 || is_training_fn(training) != 0)
        return -1;
    return 0;
}

/* Whether this call's autograd state is the one the scope's pending calls
 * were recorded under (BatchingScope.mode, 2 * recording + training); if
 * not, the Python version runs them first (block.autograd_mode). */
static int mode_matches(PyObject *scope)
{
    bool recording = false, training = false;
    if (Py_TYPE(scope) != ScopeType || autograd_flags(&recording, &training) != 0)
        return 0;
    PyObject *mode = SLOT(scope, sc_mode);
    return mode != NULL && PyLong_CheckExact(mode)
        && PyLong_AsLong(mode) == 2 * (long)recording + (long)training;
}

static PyObject *scope_field(PyObject *scope, Py_ssize_t offset, PyObject *name)
{
    if (Py_TYPE(scope) != ScopeType)
        return PyObject_GetAttr(scope, name);
    PyObject *value = SLOT(scope, offset);
    if (value == NULL)
        PyErr_SetObject(PyExc_AttributeError, name);
    return Py_XNewRef(value);
}

#define BAIL(label) do { goto label; } while (0)

/* The item size of numpy dtype objects met lately, -1 for a dtype whose
 * arrays are not merged: not in the machine's byte order (a signature
 * names the dtype's type, and '<f4' and '>f4' bytes mean other values).
 * An entry holds its dtype, so no other dtype takes its address while the
 * entry lives. */
#define ITEMSIZE_CACHE_BITS 6
static struct { PyObject *descr; Py_ssize_t size; } itemsizes[1 << ITEMSIZE_CACHE_BITS];

static Py_ssize_t numpy_itemsize(PyObject *descr)
{
    size_t slot = address_slot(descr, ITEMSIZE_CACHE_BITS);
    if (itemsizes[slot].descr == descr)
        return itemsizes[slot].size;
    PyObject *value = PyObject_GetAttr(descr, s_itemsize);
    Py_ssize_t size = value ? PyLong_AsSsize_t(value) : -1;
    Py_XDECREF(value);
    PyObject *native = size > 0 ? PyObject_GetAttr(descr, s_isnative) : NULL;
    int is_native = native ? PyObject_IsTrue(native) : -1;
    Py_XDECREF(native);
    if (is_native < 0) {
        PyErr_Clear();
        return -1;
    }
    Py_INCREF(descr);
    Py_XSETREF(itemsizes[slot].descr, descr);
    itemsizes[slot].size = is_native ? size : -1;
    return itemsizes[slot].size;
}

#define REPEAT_BYTES 256    /* block.REPEAT_BYTES */

/* block.repeat_key in C: the signature id (8 bytes, little-endian), then
 * each numpy leaf's bytes; NULL without an error when a leaf is not a
 * C-contiguous array in the machine's byte order whose fields NumpyFields
 * reads, or when they hold more than REPEAT_BYTES (the call then simply
 * records a node of its own). */
static PyObject *repeat_key(long sig_id, PyObject *const *leaves, Py_ssize_t n)
{
    Py_ssize_t total = 8;
    if (!numpy_fields_read)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        const NumpyFields *array = (const NumpyFields *)leaves[i];
        if (Py_TYPE(array) != NumpyType || !(array->flags & NUMPY_C_CONTIGUOUS))
            return NULL;
        Py_ssize_t size = numpy_itemsize(array->descr);
        if (size < 0)
            return NULL;
        for (int d = 0; d < array->nd; d++)
            size *= array->dimensions[d];
        total += size;
        if (total > 8 + REPEAT_BYTES)
            return NULL;
    }
    PyObject *key = PyBytes_FromStringAndSize(NULL, total);
    if (key == NULL)
        return NULL;
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(key);
    uint64_t id = (uint64_t)(int64_t)sig_id;
    for (int b = 0; b < 8; b++)
        out[b] = (unsigned char)(id >> (8 * b));
    out += 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        const NumpyFields *array = (const NumpyFields *)leaves[i];
        Py_ssize_t size = numpy_itemsize(array->descr);
        for (int d = 0; d < array->nd; d++)
            size *= array->dimensions[d];
        memcpy(out, array->data, size);
        out += size;
    }
    return key;
}

/* The lazy results of ``node``, nested as ``info``'s outputs
 * (graph.lazy_results). */
static PyObject *lazy_results(PyObject *node, int results)
{
    if (results == RESULTS_ONE)
        return new_lazy(node, int_zero);
    if (results == RESULTS_PAIR) {
        PyObject *first = new_lazy(node, int_zero);
        PyObject *second = first ? new_lazy(node, int_one) : NULL;
        PyObject *result = second ? PyTuple_Pack(2, first, second) : NULL;
        Py_XDECREF(first);
        Py_XDECREF(second);
        return result;
    }
    return PyObject_CallFunctionObjArgs(lazy_results_py, node, NULL);
}

/* The node of what BatchingScope.repeats holds for a call (graph.repeat_node):
 * the node itself, or the call's results, when they are a lazy value or a
 * tuple of them (borrowed; NULL for anything else). */
static PyObject *repeat_node(PyObject *first)
{
    if (Py_TYPE(first) == NodeType)
        return first;
    if (PyTuple_CheckExact(first) && PyTuple_GET_SIZE(first) > 0)
        first = PyTuple_GET_ITEM(first, 0);
    return Py_TYPE(first) == LazyValueType ? SLOT(first, lv_node) : NULL;
}

static int ndarray_fields(PyObject *leaf, PyObject **shape, PyObject **dtype, PyObject **ctx);
static PyObject *bool_type;     /* numpy's bool (see set_ndarray_readers) */
static int contexts_differ(PyObject *a, PyObject *b);

/* BatchingScope.record for the common case; None when the Python version
 * must run instead (nothing has been changed then). */
static PyObject *record_args(PyObject *scope, PyObject *dblock, PyObject *const *args,
                             Py_ssize_t nargs)
{
    uint64_t start = ticks();
    PyObject *leaves = NULL, *fmt = NULL, *key = NULL, *ctx = NULL, *dtype = NULL,
             *sig = NULL, *node = NULL, *result = NULL, *signatures = NULL,
             *depth_obj = NULL, *pending = NULL, *keep = NULL, *tape = NULL;
    PyObject *marks_inline[MAX_INLINE_MARKS];
    PyObject **marks = marks_inline;
    /* every leaf's dtype (borrowed), for a key of leaves of several dtypes */
    PyObject *dtypes_inline[MAX_INLINE_MARKS];
    PyObject **leaf_dtypes = dtypes_inline;
    int mixed = 0;
    Py_ssize_t n_marks = 0;
    long depth = 0;
    int host_only = 1;          /* every leaf a numpy array */
    PyObject *repeat = NULL;
    PyObject *ctx_array = NULL;     /* the NDArray whose Context (devices') ``ctx`` is */
    CallWords words;
    words.n_leaves = 0;
    PyObject *const *leaf_items;    /* the call's leaves (``leaves`` once a list is made) */
    Py_ssize_t leaf_count;

    tape = scope_field(scope, sc_tape, s_tape);
    if (tape == NULL || !Py_IS_TYPE(tape, &TapeType)) BAIL(fallback);
    if (!mode_matches(scope)) BAIL(fallback);
    uint64_t hash = 0;
    int memo_rc = call_words(&words, args, nargs, &depth, marks, &n_marks, scope);
    if (memo_rc < 0) BAIL(error);
    if (memo_rc == 1) {
        hash = call_hash(&words, dblock);
        sig = memo_get(dblock, &words, hash);
        if (sig != NULL) {
            Py_INCREF(sig);
            host_only = !words.lazy && !words.arrays;   /* else numpy leaves only */
            leaf_items = words.leaves;
            leaf_count = words.n_leaves;
            goto have_signature;
        }
    }
    /* the key's way, from the start */
    leaves = PyList_New(0);
    if (leaves == NULL) BAIL(error);
    depth = 0;
    n_marks = 0;
    fmt = flatten_flat(args, nargs, leaves);
    if (fmt == NULL) BAIL(fallback);
    Py_ssize_t n = PyList_GET_SIZE(leaves);
    if (n > MAX_INLINE_MARKS) {
        marks = PyMem_Malloc(n * sizeof(PyObject *));
        leaf_dtypes = PyMem_Malloc(n * sizeof(PyObject *));
        if (marks == NULL || leaf_dtypes == NULL) { PyErr_NoMemory(); BAIL(error); }
    }
    key = PyTuple_New(n + 3);
    if (key == NULL) BAIL(error);
    Py_INCREF(fmt);
    PyTuple_SET_ITEM(key, 0, fmt);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *leaf = PyList_GET_ITEM(leaves, i);
        PyTypeObject *kind = Py_TYPE(leaf);
        PyObject *shape = NULL, *leaf_dtype = NULL, *leaf_ctx = NULL;
        int fields = 0;         /* 1: an NDArray read by ndarray_fields */
        if (kind != NumpyType)
            host_only = 0;
        if (kind == LazyValueType) {
            PyObject *producer = lazy_producer(leaf);
            if (producer == NULL) BAIL(fallback);
            /* data_marked first: it reads an attribute (Python code, where
             * another thread may take the sig_cache entry ``produced`` is) */
            if (data_marked(leaf)) BAIL(fallback);
            SigInfo *produced = sig_info(SLOT(producer, n_sig));
            if (produced == NULL) BAIL(fallback);
            PyObject *info = PyList_GetItem(produced->out_info,
                                            PyLong_AsSsize_t(SLOT(leaf, lv_index)));
            if (info == NULL || !PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 3) {
                PyErr_Clear();
                BAIL(fallback);
            }
            shape = PyTuple_GET_ITEM(info, 0);   /* the signature keeps info alive */
            leaf_dtype = PyTuple_GET_ITEM(info, 1);
            leaf_ctx = PyTuple_GET_ITEM(info, 2);
            Py_INCREF(shape);
            long state = small_int(SLOT(producer, n_state));
            if (state == DONE && producer_failed(producer)) {
                Py_DECREF(shape); PyErr_Clear(); BAIL(fallback);    /* Python raises */
            }
            if (state != DONE) {
                if (state != PENDING || SLOT(producer, n_scope) != scope) {
                    /* failed, or pending in another scope: Python raises */
                    Py_DECREF(shape); PyErr_Clear(); BAIL(fallback);
                }
                long d = small_int(SLOT(producer, n_depth));
                if (d >= depth) depth = d + 1;
                if (SLOT(producer, n_used) != Py_True)
                    marks[n_marks++] = producer;
            }
        } else if (kind == NumpyType) {
            shape = PyObject_GetAttr(leaf, s_shape);
            if (shape == NULL) BAIL(error);
            PyObject *descr = PyObject_GetAttr(leaf, s_dtype);
            if (descr == NULL) { Py_DECREF(shape); BAIL(error); }
            leaf_dtype = PyObject_GetAttr(descr, s_type);
            Py_DECREF(descr);
            if (leaf_dtype == NULL) { Py_DECREF(shape); BAIL(error); }
            Py_DECREF(leaf_dtype);          /* numpy keeps its scalar types alive */
        } else if ((fields = ndarray_fields(leaf, &shape, &leaf_dtype, &leaf_ctx)) != 0) {
            if (fields < 0) BAIL(error);
            /* dtype and context live in mx_dtypes and devices: no ``keep`` */
            if (leaf_dtype == bool_type) { Py_DECREF(shape); BAIL(fallback); }
        } else if (PyObject_TypeCheck(leaf, NDArrayType)) {
            /* properties that call into MXNet; Context objects are made anew */
            if (keep == NULL && (keep = PyList_New(0)) == NULL) BAIL(error);
            shape = PyObject_GetAttr(leaf, s_shape);
            if (shape == NULL) BAIL(error);
            leaf_dtype = PyObject_GetAttr(leaf, s_dtype);
            if (leaf_dtype != NULL && (!PyType_Check(leaf_dtype) || leaf_dtype == bool_type)) {
                /* an mxnet.numpy array's dtype object, or bool: Python refuses it */
                Py_DECREF(shape); Py_DECREF(leaf_dtype); BAIL(fallback);
            }
            leaf_ctx = leaf_dtype ? PyObject_GetAttr(leaf, s_context) : NULL;
            if (leaf_ctx == NULL || PyList_Append(keep, leaf_dtype)
                || PyList_Append(keep, leaf_ctx)) {
                Py_DECREF(shape); Py_XDECREF(leaf_dtype); Py_XDECREF(leaf_ctx);
                BAIL(error);
            }
            Py_DECREF(leaf_dtype);          /* kept alive by ``keep`` */
            Py_DECREF(leaf_ctx);
        } else {
            BAIL(fallback);                 /* the Python version raises the error */
        }
        if (leaf_ctx != ctx && leaf_ctx != NULL) {
            if (ctx == NULL) {
                ctx = Py_NewRef(leaf_ctx);  /* owned: done: drops it on every exit */
                if (fields > 0) ctx_array = leaf;   /* (``leaves`` holds it) */
            } else {
                int differ = contexts_differ(leaf_ctx, ctx);
                if (differ) { Py_DECREF(shape); BAIL(fallback); }
            }
        }
        if (leaf_dtype != dtype) {
            mixed |= dtype != NULL;
            dtype = leaf_dtype;
        }
        leaf_dtypes[i] = leaf_dtype;
        PyTuple_SET_ITEM(key, i + 1, shape);
    }
    /* a borrowed reference so far: dtype (kept alive by signatures / numpy) */
    if (ctx == NULL) {
        ctx = default_context();
        if (ctx == NULL) BAIL(error);
    }
    if (mixed) {        /* as the Python version: every leaf's, in a tuple */
        PyObject *all = PyTuple_New(n);
        if (all == NULL) BAIL(error);
        for (Py_ssize_t i = 0; i < n; i++)
            PyTuple_SET_ITEM(all, i, Py_NewRef(leaf_dtypes[i]));
        PyTuple_SET_ITEM(key, n + 1, all);
    } else {
        if (dtype == NULL) dtype = Py_None;
        Py_INCREF(dtype);
        PyTuple_SET_ITEM(key, n + 1, dtype);
    }
    {
        PyObject *ctx_key = context_key(ctx);
        if (ctx_key == NULL) BAIL(error);
        PyTuple_SET_ITEM(key, n + 2, ctx_key);
    }

    signatures = PyObject_GetAttr(dblock, s_signatures);
    if (signatures == NULL) BAIL(error);
    sig = PyDict_Check(signatures) ? PyDict_GetItemWithError(signatures, key) : NULL;
    if (sig != NULL) {
        Py_INCREF(sig);
    } else {
        if (PyErr_Occurred()) BAIL(error);
        if (ctx_array != NULL) {
            /* devices' Context is never handed on: the signature (and its
             * values' ``.context``) gets the array's own, as in Python */
            PyObject *own = PyObject_GetAttr(ctx_array, s_context);
            if (own == NULL) BAIL(fallback);
            Py_SETREF(ctx, own);
        }
        sig = PyObject_CallMethodObjArgs(dblock, s_trace, key, fmt, ctx, NULL);
        if (sig == NULL) BAIL(error);
    }
    if (memo_rc == 1)
        memo_put(dblock, &words, hash, sig);
    leaf_items = ((PyListObject *)leaves)->ob_item;
    leaf_count = n;
have_signature:
    for (Py_ssize_t i = 0; i < n_marks; i++)
        mark_used(marks[i]);

    SigInfo *info = sig_info(sig);
    if (info == NULL) BAIL(error);
    if (info->inference != NULL) {
        /* calls made outside autograd have a signature of their own, where
         * their verdict differs (BatchNorm's): block.BatchingScope.record */
        bool recording = true, training = true;
        if (autograd_flags(&recording, &training) != 0) BAIL(fallback);
        if (!recording && !training) {
            PyObject *twin = PyWeakref_GET_OBJECT(info->inference);
            if (twin == Py_None) BAIL(fallback);
            Py_SETREF(sig, Py_NewRef(twin));
            if ((info = sig_info(sig)) == NULL) BAIL(error);
        }
    }
    /* copied now: any allocation below may start a collection whose
     * finalizers (or another thread) replace this sig_cache entry */
    const long sig_id = info->sig_id;
    const int results_kind = info->results, repeatable = info->repeatable;
    info = NULL;
    /* a repeat of an earlier call (BatchingScope.record): its results */
    if (host_only && repeatable && PyDict_CheckExact(SLOT(scope, sc_repeats))) {
        repeat = repeat_key(sig_id, leaf_items, leaf_count);
        if (repeat == NULL && PyErr_Occurred()) BAIL(error);
        PyObject *first = repeat ? PyDict_GetItemWithError(SLOT(scope, sc_repeats), repeat)
                                 : NULL;
        if (first == NULL && PyErr_Occurred()) BAIL(error);
        PyObject *first_node = first ? repeat_node(first) : NULL;
        if (first_node != NULL && Py_TYPE(first_node) == NodeType
            && small_int(SLOT(first_node, n_state)) == PENDING) {
            PyObject *count = SLOT(scope, sc_repeated);
            long repeated = count && PyLong_CheckExact(count) ? PyLong_AsLong(count) : 0;
            PyObject *next = PyLong_FromLong(repeated + 1);
            if (next == NULL) BAIL(error);
            set_slot(scope, sc_repeated, next);
            result = first == first_node ? lazy_results(first_node, results_kind)
                                         : Py_NewRef(first);
            if (result == NULL) BAIL(error);
            ((TapeObject *)tape)->ticks += ticks_since(start);
            goto done;
        }
    }

    pending = scope_field(scope, sc_pending, s_pending);
    if (pending == NULL) BAIL(error);
    if (!PyList_Check(pending)) {
        PyErr_SetString(PyExc_TypeError, "scope.pending is not a list");
        BAIL(error);
    }
    depth_obj = PyLong_FromLong(depth);
    PyObject *pos = PyLong_FromSsize_t(PyList_GET_SIZE(pending));
    if (depth_obj == NULL || pos == NULL) { Py_XDECREF(pos); BAIL(error); }
    if (leaves == NULL) {       /* the memo's way: the tuple takes words' references */
        if ((leaves = PyTuple_New(leaf_count)) == NULL) { Py_DECREF(pos); BAIL(error); }
        for (Py_ssize_t i = 0; i < leaf_count; i++)
            PyTuple_SET_ITEM(leaves, i, words.leaves[i]);
        words.n_leaves = 0;
    } else {                    /* the key's way: its list, as a tuple (LEAVES_OK) */
        PyObject *tuple = PyList_AsTuple(leaves);
        if (tuple == NULL) { Py_DECREF(pos); BAIL(error); }
        Py_SETREF(leaves, tuple);
        leaf_items = NULL;      /* (pointed into the list) */
    }
    node = NodeType->tp_alloc(NodeType, 0);
    if (node == NULL) { Py_DECREF(pos); BAIL(error); }
    Py_INCREF(sig); SLOT(node, n_sig) = sig;
    Py_INCREF(leaves); SLOT(node, n_leaves) = leaves;
    Py_INCREF(depth_obj); SLOT(node, n_depth) = depth_obj;
    Py_INCREF(scope); SLOT(node, n_scope) = scope;
    SLOT(node, n_pos) = pos;
    Py_INCREF(int_zero); SLOT(node, n_state) = int_zero;       /* PENDING */
    Py_INCREF(Py_False); SLOT(node, n_used) = Py_False;
    Py_INCREF(Py_None); SLOT(node, n_arrays) = Py_None;
    Py_INCREF(int_zero); SLOT(node, n_row) = int_zero;

    if (PyList_Append(pending, node)) BAIL(error);
    /* read before lazy_results: for other nestings it runs Python code,
     * during which another thread may replace this sig_cache entry */
    push_node(&((TapeObject *)tape)->words, sig_id, leaves);
    ((TapeObject *)tape)->nodes++;
    result = lazy_results(node, results_kind);
    if (result == NULL) BAIL(error);
    /* a later equal call gets these very results when they are lazy
     * values (immutable), else new ones of this node */
    if (repeat != NULL && PyDict_SetItem(SLOT(scope, sc_repeats), repeat,
                                         results_kind == RESULTS_OTHER ? node : result)) {
        Py_CLEAR(result);
        BAIL(error);
    }

    ((TapeObject *)tape)->ticks += ticks_since(start);
    /* a pipelined scope is asked to run what it holds once flush_at calls
     * are pending (BatchingScope.pipeline): the operators then run while
     * the user records on */
    PyObject *limit = scope_field(scope, sc_flush_at, s_flush_at);
    Py_ssize_t at = PY_SSIZE_T_MAX;
    if (limit == NULL) {
        PyErr_Clear();                  /* a scope without flush_at: never */
    } else {
        at = PyLong_AsSsize_t(limit);
        Py_DECREF(limit);
        if (at == -1 && PyErr_Occurred()) { Py_CLEAR(result); BAIL(error); }
    }
    if (PyList_GET_SIZE(pending) >= at) {
        PyObject *flushed = PyObject_CallMethodNoArgs(scope, s_pipeline);
        if (flushed == NULL) { Py_CLEAR(result); BAIL(error); }
        Py_DECREF(flushed);
    }
    goto done;

fallback:
    if (!PyErr_Occurred()) {
        result = Py_None;
        Py_INCREF(result);
    } else if (PyErr_ExceptionMatches(PyExc_MemoryError)
               || !PyErr_ExceptionMatches(PyExc_Exception)) {   /* an interrupt: now */
        result = NULL;
    } else {                    /* let the Python version meet (and report) it */
        PyErr_Clear();
        result = Py_None;
        Py_INCREF(result);
    }
    goto done;
error:
    result = NULL;
done:
    if (marks != marks_inline) PyMem_Free(marks);
    if (leaf_dtypes != dtypes_inline) PyMem_Free(leaf_dtypes);
    Py_XDECREF(leaves); Py_XDECREF(fmt); Py_XDECREF(key); Py_XDECREF(ctx);
    Py_XDECREF(sig); Py_XDECREF(node); Py_XDECREF(signatures); Py_XDECREF(depth_obj);
    Py_XDECREF(pending); Py_XDECREF(keep); Py_XDECREF(tape);
    Py_XDECREF(repeat);
    for (Py_ssize_t i = 0; i < words.n_leaves; i++)
        Py_DECREF(words.leaves[i]);
    return result;
}

static PyObject *record(PyObject *self, PyObject *const *argv, Py_ssize_t argc)
{
    if (argc != 3 || !PyTuple_Check(argv[2])) {
        PyErr_SetString(PyExc_TypeError, "record(scope, dblock, args)");
        return NULL;
    }
    if (!configured) Py_RETURN_NONE;
    return record_args(argv[0], argv[1], &PyTuple_GET_ITEM(argv[2], 0), PyTuple_GET_SIZE(argv[2]));
}

/* ------------------------------------------------------------ __call__ */

/* ScopeSlot: each thread's open scope, as ``threading.local()`` holding
 * ``scope`` would keep it, in thread-specific storage that the C
 * ``__call__`` reads directly (a thread-local's attribute lookup cost ~30
 * ns more per recorded call).  Holds a reference to each thread's value;
 * block.py sets it back to None when a scope closes. */
typedef struct {
    PyObject_HEAD
    Py_tss_t key;
} ScopeSlotObject;

static PyTypeObject ScopeSlotType;

static PyObject *scope_slot_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    ScopeSlotObject *slot = (ScopeSlotObject *)type->tp_alloc(type, 0);
    if (slot == NULL) return NULL;
    slot->key = (Py_tss_t)Py_tss_NEEDS_INIT;
    if (PyThread_tss_create(&slot->key)) {
        Py_DECREF(slot);
        return PyErr_NoMemory();
    }
    return (PyObject *)slot;
}

static void scope_slot_dealloc(ScopeSlotObject *slot)
{
    Py_XDECREF((PyObject *)PyThread_tss_get(&slot->key));   /* this thread's */
    PyThread_tss_delete(&slot->key);
    Py_TYPE(slot)->tp_free((PyObject *)slot);
}

/* This thread's value (a new reference; None when unset). */
static PyObject *scope_slot_read(ScopeSlotObject *slot)
{
    PyObject *value = (PyObject *)PyThread_tss_get(&slot->key);
    return Py_NewRef(value ? value : Py_None);
}

static PyObject *scope_slot_get(ScopeSlotObject *slot, void *closure)
{
    return scope_slot_read(slot);
}

static int scope_slot_set(ScopeSlotObject *slot, PyObject *value, void *closure)
{
    PyObject *old = (PyObject *)PyThread_tss_get(&slot->key);
    PyObject *new = value == NULL || value == Py_None ? NULL : Py_NewRef(value);
    if (PyThread_tss_set(&slot->key, new)) {
        Py_XDECREF(new);
        PyErr_SetString(PyExc_RuntimeError, "ScopeSlot: thread-specific storage failed");
        return -1;
    }
    Py_XDECREF(old);
    return 0;
}

static PyGetSetDef scope_slot_getset[] = {
    {"scope", (getter)scope_slot_get, (setter)scope_slot_set,
     "this thread's open BatchingScope, or None", NULL},
    {NULL}
};

static PyTypeObject ScopeSlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gluon_dynbatch._speedups.ScopeSlot",
    .tp_basicsize = sizeof(ScopeSlotObject),
    .tp_dealloc = (destructor)scope_slot_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Each thread's open scope (.scope), like threading.local(), read in C.",
    .tp_getset = scope_slot_getset,
    .tp_new = scope_slot_new,
};

static PyObject *local_state, *call_py, *s_scope;

/* DynBatchBlock.__call__ in C: inside a scope, record (no Python frame at
 * all for the common case, which measured a third of a recorded call);
 * otherwise, when record_args defers, or for keyword arguments (which it
 * refuses, naming the block), the Python __call__ (call_py). */
static PyObject *block_call(PyObject *self, PyObject *const *args, Py_ssize_t nargsf,
                            PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    Py_ssize_t nkw = kwnames == NULL ? 0 : PyTuple_GET_SIZE(kwnames);
    if (nkw == 0) {
        PyObject *scope = !configured ? NULL
            : Py_IS_TYPE(local_state, &ScopeSlotType)
            ? scope_slot_read((ScopeSlotObject *)local_state)
            : PyObject_GetAttr(local_state, s_scope);
        if (scope == NULL && configured) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return NULL;
            PyErr_Clear();
        } else if (scope != Py_None) {
            PyObject *result = record_args(scope, self, args, nargs);
            Py_DECREF(scope);
            if (result != Py_None) return result;     /* a result, or an error */
            Py_DECREF(result);
        } else {
            Py_DECREF(scope);
        }
    }
    PyObject *tuple = PyTuple_New(nargs), *kwargs = nkw ? PyDict_New() : NULL, *result = NULL;
    if (tuple == NULL || (nkw && kwargs == NULL)) goto done;
    for (Py_ssize_t i = 0; i < nargs; i++) {
        Py_INCREF(args[i]);
        PyTuple_SET_ITEM(tuple, i, args[i]);
    }
    for (Py_ssize_t i = 0; i < nkw; i++)
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i])) goto done;
    PyObject *pair = PyTuple_Pack(2, self, tuple);
    if (pair != NULL) {
        result = PyObject_Call(call_py, pair, kwargs);
        Py_DECREF(pair);
    }
done:
    Py_XDECREF(tuple);
    Py_XDECREF(kwargs);
    return result;
}

static PyMethodDef block_call_def = {
    "__call__", (PyCFunction)(void (*)(void))block_call, METH_FASTCALL | METH_KEYWORDS,
    "Record the call inside a batching() scope, else call the wrapped block "
    "(DynBatchBlock.__call__ in C; see gluon_dynbatch.accel)."
};

/* call_method(cls, local, call_py, scope_cls): a __call__ method for
 * ``cls``; scopes of ``scope_cls`` have their fields read from its slots */
static PyObject *call_method(PyObject *self, PyObject *args)
{
    PyObject *cls, *local, *fallback, *scope_cls;
    if (!PyArg_ParseTuple(args, "O!OOO!", &PyType_Type, &cls, &local, &fallback,
                          &PyType_Type, &scope_cls))
        return NULL;
    if (slot_offset((PyTypeObject *)scope_cls, "tape", &sc_tape)
        || slot_offset((PyTypeObject *)scope_cls, "pending", &sc_pending)
        || slot_offset((PyTypeObject *)scope_cls, "flush_at", &sc_flush_at)
        || slot_offset((PyTypeObject *)scope_cls, "mode", &sc_mode)
        || slot_offset((PyTypeObject *)scope_cls, "repeats", &sc_repeats)
        || slot_offset((PyTypeObject *)scope_cls, "repeated", &sc_repeated)
        || slot_offset((PyTypeObject *)scope_cls, "failure", &sc_failure))
        return NULL;
    Py_INCREF(scope_cls);
    Py_XSETREF(ScopeType, (PyTypeObject *)scope_cls);
    Py_INCREF(local); Py_XSETREF(local_state, local);
    Py_INCREF(fallback); Py_XSETREF(call_py, fallback);
    return PyDescr_NewMethod((PyTypeObject *)cls, &block_call_def);
}

/* ------------------------------------------------------- structure_key */

/* The words of a Tape (see there) for nodes recorded without one, as bytes:
 * with the C extension in use, every structure key is such bytes. */
static PyObject *structure_key(PyObject *self, PyObject *nodes)
{
    if (!configured || !PyList_Check(nodes)) {
        PyErr_SetString(PyExc_TypeError, "structure_key(list of nodes), after configure()");
        return NULL;
    }
    Words words = {NULL, 0, 0, 0};
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(nodes); i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        if (Py_TYPE(node) != NodeType || !LEAVES_OK(SLOT(node, n_leaves))) {
            PyErr_SetString(PyExc_TypeError, "structure_key: not a recorded Node");
            PyMem_Free(words.data);
            return NULL;
        }
        PyObject *id = PyObject_GetAttr(SLOT(node, n_sig), s_sig_id);
        long sig_id = id ? PyLong_AsLong(id) : -1;
        Py_XDECREF(id);
        if (sig_id == -1 && PyErr_Occurred()) { PyMem_Free(words.data); return NULL; }
        push_node(&words, sig_id, SLOT(node, n_leaves));
    }
    if (words.broken) {
        PyMem_Free(words.data);
        return PyErr_NoMemory();
    }
    PyObject *out = take_words(&words);
    PyMem_Free(words.data);
    return out;
}

/* -------------------------------------------------------- gather_index */

/* The leading dimension of MXNet arrays, asked through MXNet's C API
 * (MXNDArrayGetShapeEx, or its 64-bit twin when MXNet was built with large
 * tensors), whose address set_shape_reader() is given: ``NDArray.shape``
 * wraps the same call in ~1 us of Python, and a SICK minibatch of 256 asks
 * it ~370 times.  Without the address, or for anything but a plain NDArray
 * with a known shape, ``array.shape[0]``. */
typedef int (*ShapeReader32)(void *, int *, const int **);
typedef int (*ShapeReader64)(void *, int *, const int64_t **);
static void *shape_reader = NULL;
static int shape_reader_64 = 0;
static PyObject *s_handle;

static PyObject *set_shape_reader(PyObject *self, PyObject *args)
{
    PyObject *address;
    int is_64;
    if (!PyArg_ParseTuple(args, "Op", &address, &is_64))
        return NULL;
    void *fn = address == Py_None ? NULL : PyLong_AsVoidPtr(address);
    if (fn == NULL && PyErr_Occurred()) return NULL;
    shape_reader = fn;
    shape_reader_64 = is_64;
    Py_RETURN_NONE;
}

static void *array_handle(PyObject *array)
{
    PyObject *handle = PyObject_GetAttr(array, s_handle);    /* a ctypes c_void_p */
    PyObject *value = handle ? PyObject_GetAttr(handle, s_value) : NULL;
    void *ptr = value && value != Py_None ? PyLong_AsVoidPtr(value) : NULL;
    Py_XDECREF(handle);
    Py_XDECREF(value);
    if (ptr == NULL) PyErr_Clear();
    return ptr;
}

/* The dimensions of the array behind ``handle`` through the shape reader
 * (either width), copied into ``dims`` (MAX_RANK of them at most: MXNet
 * keeps them in a thread-local buffer that its next API call may reuse);
 * the rank, or -1 where the reader fails or the rank is larger. */
#define MAX_RANK 32
static int read_dims(void *handle, int64_t *dims)
{
    int ndim = -1;
    if (shape_reader_64) {
        const int64_t *data;
        if (((ShapeReader64)shape_reader)(handle, &ndim, &data) != 0 || ndim < 0
            || ndim > MAX_RANK)
            return -1;
        memcpy(dims, data, ndim * sizeof(int64_t));
    } else {
        const int *data;
        if (((ShapeReader32)shape_reader)(handle, &ndim, &data) != 0 || ndim < 0
            || ndim > MAX_RANK)
            return -1;
        for (int i = 0; i < ndim; i++)
            dims[i] = data[i];
    }
    return ndim;
}

/* Rows of ``array`` (its leading dimension); -1 with an exception set. */
static Py_ssize_t leading_rows(PyObject *array)
{
    if (shape_reader != NULL && PyObject_TypeCheck(array, NDArrayType)) {
        void *handle = array_handle(array);
        int64_t dims[MAX_RANK];
        if (handle != NULL && read_dims(handle, dims) > 0)
            return (Py_ssize_t)dims[0];
    }
    PyObject *shape = PyObject_GetAttr(array, s_shape);
    PyObject *first = shape ? PySequence_GetItem(shape, 0) : NULL;
    Py_ssize_t rows = first ? PyLong_AsSsize_t(first) : -1;
    Py_XDECREF(shape);
    Py_XDECREF(first);
    return rows;
}

/* ------------------------------------------------------ NDArray leaves */

/* A call given an NDArray read its shape, dtype and context through
 * NDArray's properties: three ctypes calls, and a new Context object each
 * time, ~3.5 us of a recorded call that otherwise takes ~0.3.  For a plain
 * NDArray (or one of this package's subclasses that inherit the three
 * properties, set_ndarray_readers' ``types``) the recorder asks MXNet's C
 * API directly, as the properties do: MXNDArrayGetDType and
 * MXNDArrayGetContext, whose addresses set_ndarray_readers() is given, and
 * the shape reader above.  Without them, or for anything they do not
 * answer, the properties are read as before. */
typedef int (*GetDType)(void *, int *);
typedef int (*GetContext)(void *, int *, int *);
static GetDType get_dtype_fn = NULL;
static GetContext get_context_fn = NULL;
static PyTypeObject *ContextType;
static PyObject *ndarray_types;     /* a tuple of the subclasses read so too */

/* _DTYPE_MX_TO_NP by MXNet's dtype id: what ``NDArray.dtype`` returns
 * (NULL: ask the property) */
#define MX_DTYPES 16
static PyObject *mx_dtypes[MX_DTYPES];
/* bool_type (declared before record_args) is MXNet's dtype 7 (mshadow's
 * kBool), numpy's bool: an NDArray leaf of it is left to the Python
 * version, which refuses it (MXNet 1.9.1 cannot concatenate or slice bool
 * arrays); a numpy one is host data */
#define MX_BOOL 7

/* One Context per device met, as ``NDArray.context`` made it the first
 * time, to compare contexts by identity and key signatures by.  Never
 * replaced once set, so a reference borrowed from here stays valid; and
 * never handed on: a signature traced for a call gets the leaf's own
 * Context (see record_args), since ``with ctx:`` keeps state on the
 * object, which must not be shared with other signatures' values. */
#define DEVICES 16
static struct { int type, id; PyObject *ctx; } devices[DEVICES];

static PyObject *set_ndarray_readers(PyObject *self, PyObject *args)
{
    PyObject *dtype_address, *context_address, *table, *context_type, *types;
    if (!PyArg_ParseTuple(args, "OOO!O!O!", &dtype_address, &context_address, &PyDict_Type,
                          &table, &PyType_Type, &context_type, &PyTuple_Type, &types))
        return NULL;
    void *dtype_fn = dtype_address == Py_None ? NULL : PyLong_AsVoidPtr(dtype_address);
    void *context_fn = context_address == Py_None ? NULL : PyLong_AsVoidPtr(context_address);
    if (PyErr_Occurred()) return NULL;
    for (int i = 0; i < MX_DTYPES; i++) {
        PyObject *key = PyLong_FromLong(i);
        PyObject *value = key ? PyDict_GetItemWithError(table, key) : NULL;   /* borrowed */
        Py_XDECREF(key);
        if (value == NULL && PyErr_Occurred()) return NULL;
        /* (the old one is left alive: a recording thread may hold it borrowed) */
        mx_dtypes[i] = value == Py_None ? NULL : Py_XNewRef(value);
    }
    if (mx_dtypes[MX_BOOL] != NULL) bool_type = mx_dtypes[MX_BOOL];    /* (kept alive there) */
    Py_INCREF(context_type);
    Py_INCREF(types);
    ContextType = (PyTypeObject *)context_type;
    Py_XSETREF(ndarray_types, types);
    /* either missing: neither is used */
    get_dtype_fn = dtype_fn && context_fn ? (GetDType)dtype_fn : NULL;
    get_context_fn = dtype_fn && context_fn ? (GetContext)context_fn : NULL;
    Py_RETURN_NONE;
}

/* Whether ``kind`` is NDArray or one of set_ndarray_readers' ``types``. */
static int plain_ndarray(PyTypeObject *kind)
{
    if (kind == NDArrayType)
        return 1;
    for (Py_ssize_t i = 0; ndarray_types && i < PyTuple_GET_SIZE(ndarray_types); i++)
        if ((PyObject *)kind == PyTuple_GET_ITEM(ndarray_types, i))
            return 1;
    return 0;
}

/* Whether arrays of type ``kind`` are read through the C API. */
static int read_directly(PyTypeObject *kind)
{
    return get_dtype_fn != NULL && shape_reader != NULL && plain_ndarray(kind);
}

/* An exception met on a fast path, which then gives up: 0 (cleared: the
 * properties meet it again and raise it) for an ordinary one, -1 (kept)
 * for an interrupt or MemoryError, which must reach the caller now. */
static int give_up(void)
{
    if (PyErr_Occurred() && (PyErr_ExceptionMatches(PyExc_MemoryError)
                             || !PyErr_ExceptionMatches(PyExc_Exception)))
        return -1;
    PyErr_Clear();
    return 0;
}

/* devices' Context of MXNet device (type, id) (borrowed), made by reading
 * ``array.context`` once; NULL (and 0 or -1 as give_up) where that fails,
 * returns anything but a Context of this device, or the table is full. */
static PyObject *device_context(PyObject *array, int type, int id, int *rc)
{
    int i;
    for (i = 0; i < DEVICES && devices[i].ctx != NULL; i++)
        if (devices[i].type == type && devices[i].id == id)
            return devices[i].ctx;
    *rc = 0;
    if (i == DEVICES)
        return NULL;
    PyObject *ctx = PyObject_GetAttr(array, s_context);     /* Python code */
    PyObject *key = ctx && Py_TYPE(ctx) == ContextType ? context_key(ctx) : NULL;
    int ok = key != NULL
        && PyLong_AsLong(PyTuple_GET_ITEM(key, 0)) == type
        && PyLong_AsLong(PyTuple_GET_ITEM(key, 1)) == id && !PyErr_Occurred();
    Py_XDECREF(key);
    if (!ok) {
        Py_XDECREF(ctx);
        *rc = give_up();
        return NULL;
    }
    /* another thread may have added entries while the property ran */
    for (i = 0; i < DEVICES && devices[i].ctx != NULL; i++)
        if (devices[i].type == type && devices[i].id == id) {
            Py_DECREF(ctx);
            return devices[i].ctx;
        }
    if (i == DEVICES) {
        Py_DECREF(ctx);
        return NULL;
    }
    devices[i].type = type;
    devices[i].id = id;
    devices[i].ctx = ctx;       /* (the table's reference) */
    return ctx;
}

/* NDArray ``leaf``'s shape (a new tuple), dtype and context (both borrowed,
 * from mx_dtypes and devices), read through MXNet's C API as its
 * properties read them: 1 if read, else 0 (the properties must be read:
 * another type, a null handle, an error return, an unknown dtype or
 * device, a shape of unknown rank) or -1 (an interrupt, see give_up). */
/* NDArray ``leaf``'s handle, dtype id and device (type, id), asked
 * through MXNet's C API; 0 (no error set) where its properties must be
 * read instead (see ndarray_fields). */
static int ndarray_ids(PyObject *leaf, void **handle, int *mx_dtype, int *type, int *id)
{
    if (!read_directly(Py_TYPE(leaf)))
        return 0;
    *handle = array_handle(leaf);
    return *handle != NULL && get_dtype_fn(*handle, mx_dtype) == 0
        && *mx_dtype >= 0 && *mx_dtype < MX_DTYPES && mx_dtypes[*mx_dtype] != NULL
        && get_context_fn(*handle, type, id) == 0;
}

static int ndarray_fields(PyObject *leaf, PyObject **shape, PyObject **dtype, PyObject **ctx)
{
    void *handle;
    int mx_dtype = -1, type = -1, id = -1, ndim = -1, rc = 0;
    if (!ndarray_ids(leaf, &handle, &mx_dtype, &type, &id))
        return 0;
    PyObject *context = device_context(leaf, type, id, &rc);
    if (context == NULL)
        return rc;
    int64_t data[MAX_RANK];
    PyObject *dims = NULL;
    if ((ndim = read_dims(handle, data)) >= 0 && (dims = PyTuple_New(ndim)) != NULL)
        for (int i = 0; i < ndim; i++) {
            PyObject *dim = PyLong_FromLongLong(data[i]);
            if (dim == NULL) { Py_CLEAR(dims); break; }
            PyTuple_SET_ITEM(dims, i, dim);
        }
    if (dims == NULL)
        return give_up();
    *shape = dims;
    *dtype = mx_dtypes[mx_dtype];
    *ctx = context;
    return 1;
}

/* NDArray ``leaf``'s words for the memo (see leaf_words): ARRAY_WORD, its
 * dtype id, device type and id, rank and dimensions, what its signature
 * key holds (ndarray_fields); 1 if written, 0 where its properties must be
 * read (or the words are full). */
static int ndarray_words(CallWords *cw, PyObject *leaf)
{
    void *handle;
    int mx_dtype = -1, type = -1, id = -1, ndim = -1;
    if (!ndarray_ids(leaf, &handle, &mx_dtype, &type, &id))
        return 0;
    int64_t dims[MAX_RANK];
    int ok = push_call_word(cw, NDARRAY_WORD) && push_call_word(cw, mx_dtype)
        && push_call_word(cw, type) && push_call_word(cw, id)
        && (ndim = read_dims(handle, dims)) >= 0 && push_call_word(cw, ndim);
    for (int i = 0; ok && i < ndim; i++)
        ok = push_call_word(cw, dims[i]);
    if (ok) cw->arrays = 1;
    return ok;
}

/* MXNet's device (type, id) of Context ``ctx``; 0 where unknown (not a
 * Context, or attributes other than ints) */
static int context_ids(PyObject *ctx, long *type, long *id)
{
    for (int i = 0; i < DEVICES && devices[i].ctx != NULL; i++)
        if (devices[i].ctx == ctx) {
            *type = devices[i].type;
            *id = devices[i].id;
            return 1;
        }
    if (ContextType == NULL || Py_TYPE(ctx) != ContextType)
        return 0;
    PyObject *key = context_key(ctx);
    PyObject *t = key ? PyTuple_GET_ITEM(key, 0) : NULL;
    PyObject *i = key ? PyTuple_GET_ITEM(key, 1) : NULL;
    int ok = key && PyLong_CheckExact(t) && PyLong_CheckExact(i);
    *type = ok ? PyLong_AsLong(t) : -1;
    *id = ok ? PyLong_AsLong(i) : -1;
    ok = ok && !PyErr_Occurred();
    Py_XDECREF(key);
    PyErr_Clear();
    return ok;
}

/* ``a != b`` for two contexts, as Context.__eq__ answers it (same device
 * type and id, both Contexts) without its Python where both are Contexts:
 * ~0.5 us a call that mixes lazy values and NDArrays; 1, 0 or -1. */
static int contexts_differ(PyObject *a, PyObject *b)
{
    long a_type, a_id, b_type, b_id;
    if (context_ids(a, &a_type, &a_id) && context_ids(b, &b_type, &b_id))
        return a_type != b_type || a_id != b_id;
    return PyObject_RichCompareBool(a, b, Py_NE);
}

/* Where rows live, collected leaf by leaf: the distinct source arrays in
 * order of first use (found again through a small open-addressing table
 * keyed by address: a step reads from a few arrays, but a dict of
 * PyLong ids cost ~60 ns a row) and, per leaf, its array's number and its
 * row. */
typedef struct {
    PyObject *distinct, *rows, *zero_type, *last_array;
    int *which_out, *rows_out;
    int last_number;
    PyObject **keys;        /* borrowed: ``distinct`` holds them */
    int *numbers;
    Py_ssize_t slots;       /* a power of two, at least twice the distinct arrays */
} Gather;

static int gather_start(Gather *g, Py_ssize_t n, PyObject *zero_type)
{
    g->rows = PyBytes_FromStringAndSize(NULL, n * 4);
    g->which_out = PyMem_Malloc((n ? n : 1) * sizeof(int));
    g->distinct = PyList_New(0);
    g->zero_type = zero_type;
    g->last_array = NULL;
    g->last_number = -1;
    g->slots = 16;
    g->keys = PyMem_Calloc(g->slots, sizeof(PyObject *));
    g->numbers = PyMem_Malloc(g->slots * sizeof(int));
    if (!g->rows || !g->which_out || !g->distinct || !g->keys || !g->numbers) {
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    g->rows_out = (int *)PyBytes_AS_STRING(g->rows);
    return 0;
}

static void gather_drop(Gather *g)
{
    Py_XDECREF(g->rows); Py_XDECREF(g->distinct);
    PyMem_Free(g->which_out); PyMem_Free(g->keys); PyMem_Free(g->numbers);
}

static inline Py_ssize_t gather_slot(Gather *g, PyObject *array)
{
    Py_ssize_t mask = g->slots - 1, k = ((uintptr_t)array >> 4) & mask;
    while (g->keys[k] != NULL && g->keys[k] != array) k = (k + 1) & mask;
    return k;
}

/* The number of ``array`` among the distinct arrays, added if new; -1 on error. */
static int gather_number(Gather *g, PyObject *array)
{
    Py_ssize_t k = gather_slot(g, array);
    if (g->keys[k] == array) return g->numbers[k];
    int number = (int)PyList_GET_SIZE(g->distinct);
    if (PyList_Append(g->distinct, array)) return -1;
    g->keys[k] = array;
    g->numbers[k] = number;
    if (2 * (number + 1) > g->slots) {        /* grow: rehash the distinct arrays */
        Py_ssize_t slots = g->slots * 2;
        PyObject **keys = PyMem_Calloc(slots, sizeof(PyObject *));
        int *numbers = PyMem_Malloc(slots * sizeof(int));
        if (!keys || !numbers) {
            PyMem_Free(keys); PyMem_Free(numbers);
            PyErr_NoMemory();
            return -1;
        }
        PyMem_Free(g->keys); PyMem_Free(g->numbers);
        g->keys = keys; g->numbers = numbers; g->slots = slots;
        for (int j = 0; j <= number; j++) {
            PyObject *known = PyList_GET_ITEM(g->distinct, j);
            Py_ssize_t s = gather_slot(g, known);
            g->keys[s] = known;
            g->numbers[s] = j;
        }
    }
    return number;
}

/* (distinct arrays, int32 bytes: each leaf's row in their concatenation,
 * or None when that is 0, 1, 2, ... over all their rows): what
 * execute.gather_rows returns, less its copy of the parts. */
static PyObject *gather_result(Gather *g, Py_ssize_t n)
{
    Py_ssize_t count = PyList_GET_SIZE(g->distinct), total = 0;
    int *offsets = PyMem_Malloc((count ? count : 1) * sizeof(int));
    if (offsets == NULL) { gather_drop(g); return PyErr_NoMemory(); }
    for (Py_ssize_t j = 0; j < count; j++) {
        Py_ssize_t rows = leading_rows(PyList_GET_ITEM(g->distinct, j));
        if (rows < 0 || total + rows > INT32_MAX) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "gather: more rows than an int32 index holds");
            PyMem_Free(offsets);
            gather_drop(g);
            return NULL;
        }
        offsets[j] = (int)total;
        total += rows;
    }
    int in_order = total == n;
    for (Py_ssize_t i = 0; i < n; i++) {
        int row = g->rows_out[i] + (count > 1 ? offsets[g->which_out[i]] : 0);
        g->rows_out[i] = row;
        in_order &= row == i;
    }
    PyMem_Free(offsets);
    PyObject *index = in_order ? Py_NewRef(Py_None) : Py_NewRef(g->rows);
    PyObject *out = Py_BuildValue("(ON)", g->distinct, index);
    gather_drop(g);
    return out;
}

/* Record leaf ``i``: 0 done, 1 not a computed lazy value, padding row or
 * NDArray (the caller falls back to Python), -1 error. */
static int gather_leaf(Gather *g, Py_ssize_t i, PyObject *leaf)
{
    PyObject *arrays, *array;
    Py_ssize_t index;
    long row;
    if (plain_ndarray(Py_TYPE(leaf))) {
        /* a user's array: its row 0, as execute.collect reads it (there
         * ~1.3 us a leaf, mostly ``.shape`` of each distinct array); other
         * subclasses (sparse, mxnet.numpy) are left to it */
        array = leaf;
        row = 0;
        goto found;
    }
    if (Py_TYPE(leaf) == LazyValueType) {
        PyObject *producer = SLOT(leaf, lv_node);
        arrays = SLOT(producer, n_arrays);
        row = small_int(SLOT(producer, n_row));
        index = PyLong_AsSsize_t(SLOT(leaf, lv_index));
    } else if ((PyObject *)Py_TYPE(leaf) == g->zero_type) {   /* one row, output 0 */
        arrays = PyObject_GetAttr(leaf, s_arrays);
        if (arrays == NULL) return -1;
        Py_DECREF(arrays);                  /* the padding row keeps it */
        row = 0;
        index = 0;
    } else {
        return 1;
    }
    if (arrays == NULL || (!PyList_Check(arrays) && !PyTuple_Check(arrays))) return 1;
    if (index < 0 || index >= PySequence_Fast_GET_SIZE(arrays) || row < 0 || row > INT32_MAX) {
        PyErr_Clear();
        return 1;
    }
    array = PySequence_Fast_ITEMS(arrays)[index];
found:
    if (array != g->last_array) {
        int number = gather_number(g, array);
        if (number < 0) return -1;
        g->last_array = array;
        g->last_number = number;
    }
    g->which_out[i] = g->last_number;
    g->rows_out[i] = (int)row;
    return 0;
}

/* For computed lazy values (or padding rows: anything with the same two
 * slots whose producer has ``arrays`` and ``row``) and NDArrays (see
 * gather_leaf): see gather_result.  None when a leaf is anything else. */
static PyObject *gather_index(PyObject *self, PyObject *args)
{
    PyObject *leaves, *zero_type;
    Gather g = {NULL};
    if (!PyArg_ParseTuple(args, "O!O", &PyList_Type, &leaves, &zero_type))
        return NULL;
    if (!configured) Py_RETURN_NONE;
    Py_ssize_t n = PyList_GET_SIZE(leaves);
    if (gather_start(&g, n, zero_type)) goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        int rc = gather_leaf(&g, i, PyList_GET_ITEM(leaves, i));
        if (rc < 0) goto error;
        if (rc > 0) { gather_drop(&g); Py_RETURN_NONE; }
    }
    return gather_result(&g, n);
error:
    gather_drop(&g);
    return NULL;
}

/* gather_index over one argument of every node of a step (a list or tuple
 * of nodes), without the list of leaves: ``span_of(sig)`` gives (first leaf, leaf count) of the
 * argument in a node of signature ``sig``; each node contributes
 * ``width`` entries, the missing ones (a shorter list) read ``zero``.
 * Returns (parts, index, lengths): lengths, each node's list length as
 * int32 bytes, None when none is shorter than ``width`` (a step's ragged
 * layout is read from it: execute._ragged_layout).
 * With ``compact`` a node contributes its list's elements only, list after
 * list (the index of a ragged step: execute._gather_item), ``zero`` is not
 * read, and lengths are always given.
 * None when a leaf is not one gather_index takes, a node is not a Node, a
 * list is longer than ``width`` or short with no ``zero`` (unless
 * ``compact``), or ``compact`` finds no element at all. */
#define SPAN_CACHE 8
/* Where an argument sits in each node's leaves: ``span_of(sig)`` gives
 * (position, length), asked once per signature (a step has a few). */
typedef struct {
    PyObject *span_of;
    PyObject *sigs[SPAN_CACHE];         /* borrowed: the nodes keep them */
    Py_ssize_t pos[SPAN_CACHE], len[SPAN_CACHE];
    int known;
} Spans;

/* ``node``'s leaves and the argument's span in them: 1; 0 for the Python
 * version (not a recorded node, too many signatures, a span past the
 * leaves); -1 on error. */
static int node_span(Spans *s, PyObject *node, PyObject **leaves, Py_ssize_t *pos,
                     Py_ssize_t *len)
{
    if (Py_TYPE(node) != NodeType) return 0;
    PyObject *sig = SLOT(node, n_sig);
    *leaves = SLOT(node, n_leaves);
    if (*leaves == NULL || !LEAVES_OK(*leaves)) return 0;
    int k = 0;
    while (k < s->known && s->sigs[k] != sig) k++;
    if (k == s->known) {
        if (s->known == SPAN_CACHE) return 0;
        PyObject *span = PyObject_CallOneArg(s->span_of, sig);
        if (span == NULL) return -1;
        int ok = PyArg_ParseTuple(span, "nn", &s->pos[k], &s->len[k]);
        Py_DECREF(span);
        if (!ok) return -1;
        s->sigs[k] = sig;
        s->known++;
    }
    *pos = s->pos[k];
    *len = s->len[k];
    return *pos >= 0 && *pos + *len <= PySequence_Fast_GET_SIZE(*leaves);
}

static PyObject *gather_item(PyObject *self, PyObject *args)
{
    PyObject *nodes, *zero, *zero_type, *lengths = NULL;
    Py_ssize_t width, count = 0;
    int short_lists = 0, compact = 0;
    Gather g = {NULL};
    Spans spans = {NULL};
    if (!PyArg_ParseTuple(args, "OOnOO|p", &nodes, &spans.span_of, &width, &zero, &zero_type,
                          &compact))
        return NULL;
    if (!configured || !(PyList_Check(nodes) || PyTuple_Check(nodes)) || width <= 0)
        Py_RETURN_NONE;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(nodes);
    if (gather_start(&g, n * width, zero_type)) goto error;
    if ((lengths = PyBytes_FromStringAndSize(NULL, (n ? n : 1) * 4)) == NULL) goto error;
    int32_t *length_out = (int32_t *)PyBytes_AS_STRING(lengths);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *leaves;
        Py_ssize_t pos, len;
        int found = node_span(&spans, PySequence_Fast_ITEMS(nodes)[i], &leaves, &pos, &len);
        if (found < 0) goto error;
        if (!found || len > width || (len < width && zero == Py_None && !compact))
            goto fallback;
        length_out[i] = (int32_t)len;
        short_lists |= len < width;
        PyObject **items = PySequence_Fast_ITEMS(leaves) + pos;
        Py_ssize_t entries = compact ? len : width;
        for (Py_ssize_t j = 0; j < entries; j++) {
            int rc = gather_leaf(&g, count++, j < len ? items[j] : zero);
            if (rc < 0) goto error;
            if (rc > 0) goto fallback;
        }
    }
    if (count == 0) goto fallback;
    if (count < n * width) {        /* compact: the index holds the elements only */
        if (_PyBytes_Resize(&g.rows, count * 4)) goto error;
        g.rows_out = (int *)PyBytes_AS_STRING(g.rows);
    }
    PyObject *gathered = gather_result(&g, count);
    if (gathered == NULL) { Py_DECREF(lengths); return NULL; }
    /* (parts, index, each list's length or None when none is short) */
    short_lists |= compact;
    PyObject *out = Py_BuildValue("(OON)", PyTuple_GET_ITEM(gathered, 0),
                                  PyTuple_GET_ITEM(gathered, 1),
                                  short_lists ? lengths : Py_NewRef(Py_None));
    if (!short_lists) Py_DECREF(lengths);
    Py_DECREF(gathered);
    return out;
fallback:
    gather_drop(&g);
    Py_XDECREF(lengths);
    Py_RETURN_NONE;
error:
    gather_drop(&g);
    Py_XDECREF(lengths);
    return NULL;
}

/* --------------------------------------------------------- host_rows */

/* Host rows being concatenated: numpy arrays of the first one's format and
 * size, C-contiguous.  np.concatenate of thousands of one-row arrays (a
 * token id per call) costs ~0.4 us a row, a buffer request per row ~0.1 us;
 * with NumpyFields a row that matches the first one's dtype object and
 * shape is copied straight from its data. */
typedef struct {
    Py_ssize_t rows, size;
    char format[16];
    const NumpyFields *first;       /* borrowed: the caller's leaves hold it */
    PyObject *out;
    char *dest;
} HostRows;

/* Copy ``leaf`` as row ``i``: 0 done, 1 not a row like the first, -1 error. */
static int host_row(HostRows *h, PyObject *leaf, Py_ssize_t i)
{
    if (Py_TYPE(leaf) != NumpyType) return 1;
    const NumpyFields *array = (const NumpyFields *)leaf;
    if (h->first != NULL && array->descr == h->first->descr && array->nd == h->first->nd
        && (array->flags & NUMPY_C_CONTIGUOUS)
        && !memcmp(array->dimensions, h->first->dimensions, array->nd * sizeof(Py_ssize_t))) {
        memcpy(h->dest + i * h->size, array->data, h->size);
        return 0;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(leaf, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)) {
        PyErr_Clear();
        return 1;
    }
    const char *fmt = view.format ? view.format : "B";
    if (h->out == NULL) {
        h->size = view.len;
        if (strlen(fmt) >= sizeof(h->format) ||
            (h->out = PyBytes_FromStringAndSize(NULL, h->size * h->rows)) == NULL) {
            PyBuffer_Release(&view);
            return PyErr_Occurred() ? -1 : 1;
        }
        strcpy(h->format, fmt);
        h->dest = PyBytes_AS_STRING(h->out);
        if (numpy_fields_read && (array->flags & NUMPY_C_CONTIGUOUS))
            h->first = array;
    } else if (view.len != h->size || strcmp(fmt, h->format) != 0) {
        PyBuffer_Release(&view);
        return 1;
    }
    memcpy(h->dest + i * h->size, view.buf, h->size);
    PyBuffer_Release(&view);
    return 0;
}

/* The bytes of the numpy arrays ``leaves`` (C-contiguous, one format and
 * size), concatenated; None otherwise. */
static PyObject *host_rows(PyObject *self, PyObject *leaves)
{
    if (!configured || !PyList_Check(leaves) || PyList_GET_SIZE(leaves) == 0)
        Py_RETURN_NONE;
    HostRows h = {PyList_GET_SIZE(leaves), 0, "", NULL, NULL, NULL};
    for (Py_ssize_t i = 0; i < h.rows; i++) {
        int rc = host_row(&h, PyList_GET_ITEM(leaves, i), i);
        if (rc) {
            Py_XDECREF(h.out);
            if (rc < 0) return NULL;
            Py_RETURN_NONE;
        }
    }
    return h.out;
}

/* host_rows of one argument (not a list) of every node, found where
 * ``span_of(sig)`` says, ``(position, 1)``: execute._item_rows and
 * host_rows in one pass. */
static PyObject *host_item(PyObject *self, PyObject *args)
{
    PyObject *nodes;
    Spans spans = {NULL};
    if (!PyArg_ParseTuple(args, "OO", &nodes, &spans.span_of))
        return NULL;
    if (!configured || !(PyList_Check(nodes) || PyTuple_Check(nodes))
        || PySequence_Fast_GET_SIZE(nodes) == 0)
        Py_RETURN_NONE;
    HostRows h = {PySequence_Fast_GET_SIZE(nodes), 0, "", NULL, NULL, NULL};
    for (Py_ssize_t i = 0; i < h.rows; i++) {
        PyObject *leaves;
        Py_ssize_t pos, len;
        int rc = node_span(&spans, PySequence_Fast_ITEMS(nodes)[i], &leaves, &pos, &len);
        if (rc > 0 && len != 1)
            rc = 0;
        if (rc > 0) {       /* host_row: 0 copied, 1 not a row like the first, -1 error */
            int copied = host_row(&h, PySequence_Fast_GET_ITEM(leaves, pos), i);
            rc = copied < 0 ? -1 : copied == 0;
        }
        if (rc <= 0) {
            Py_XDECREF(h.out);
            if (rc < 0) return NULL;
            Py_RETURN_NONE;
        }
    }
    return h.out;
}

/* ------------------------------------------------------- finish_nodes */

/* The nodes of a step were recorded far apart, and dropping a node's
 * leaves walks its list, the list's items and what they free: each level
 * waits on memory and depends on the one before.  So while node i is
 * finished, node i+4's list, node i+2's item array and node i+1's items
 * are fetched (the nodes themselves were read by the type checks).  At
 * SICK minibatch 256 this pass fell from 2.2 to 1.4 ms; fetching more
 * levels (producers, their arrays) lost that gain. */
static inline void prefetch_leaves(PyObject *const *nodes, Py_ssize_t n, Py_ssize_t i)
{
    PyObject *leaves;
    if (i + 4 < n && (leaves = SLOT(nodes[i + 4], n_leaves)) != NULL)
        PREFETCH(leaves);
    if (i + 2 < n && (leaves = SLOT(nodes[i + 2], n_leaves)) != NULL && PyList_Check(leaves))
        PREFETCH(((PyListObject *)leaves)->ob_item);    /* (a tuple's items are inline) */
    if (i + 1 < n && (leaves = SLOT(nodes[i + 1], n_leaves)) != NULL && LEAVES_OK(leaves))
        for (Py_ssize_t j = 0; j < PySequence_Fast_GET_SIZE(leaves); j++)
            PREFETCH(PySequence_Fast_GET_ITEM(leaves, j));
}

/* After a step ran: every node's outputs are ``arrays``, its row its
 * position (or ``rows[i]``: an int32 buffer, one entry per node); it is
 * DONE and drops its argument leaves. */
static PyObject *finish_nodes(PyObject *self, PyObject *args)
{
    PyObject *nodes, *arrays, *rows_obj = Py_None;
    Py_buffer rows = {0};
    if (!PyArg_ParseTuple(args, "OO|O", &nodes, &arrays, &rows_obj))
        return NULL;
    if (!configured || !(PyList_Check(nodes) || PyTuple_Check(nodes))) {
        PyErr_SetString(PyExc_TypeError, "finish_nodes(list or tuple of nodes, arrays)");
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(nodes);
    PyObject **items = PySequence_Fast_ITEMS(nodes);
    for (Py_ssize_t i = 0; i < n; i++)
        if (Py_TYPE(items[i]) != NodeType) {
            PyErr_SetString(PyExc_TypeError, "finish_nodes: not a Node");
            return NULL;
        }
    const int *row_of = NULL;
    if (rows_obj != Py_None) {
        if (PyObject_GetBuffer(rows_obj, &rows, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT))
            return NULL;
        if (rows.itemsize != 4 || rows.len != n * 4 ||
            (rows.format && strcmp(rows.format, "i") && strcmp(rows.format, "=i") &&
             strcmp(rows.format, "<i"))) {
            PyBuffer_Release(&rows);
            PyErr_SetString(PyExc_TypeError, "finish_nodes: rows must be int32, one per node");
            return NULL;
        }
        row_of = (const int *)rows.buf;
    }
    PyObject *done = PyLong_FromLong(DONE);
    if (done == NULL) goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        prefetch_leaves(items, n, i);
        PyObject *row = PyLong_FromSsize_t(row_of ? row_of[i] : i);
        if (row == NULL) { Py_DECREF(done); goto error; }
        PyObject *node = items[i];
        Py_INCREF(arrays); set_slot(node, n_arrays, arrays);
        set_slot(node, n_row, row);
        Py_INCREF(done); set_slot(node, n_state, done);
        Py_INCREF(Py_None); set_slot(node, n_leaves, Py_None);
    }
    Py_DECREF(done);
    if (row_of) PyBuffer_Release(&rows);
    Py_RETURN_NONE;
error:
    if (row_of) PyBuffer_Release(&rows);
    return NULL;
}

/* ------------------------------------------------------- count_groups */

/* plan.count_groups_py in C: (calls per (depth, family), those of them
 * read by a later call of the flush, calls that run alone).  Recording in
 * C leaves this to one pass at the flush: counting per call was 30% of a
 * recorded call. */
typedef struct {
    long depth, family;             /* the key; depth -1: empty slot */
    PyObject *depth_obj, *family_obj;   /* borrowed: the nodes keep them */
    Py_ssize_t count, used;
} GroupCount;

static size_t count_slot(const GroupCount *table, Py_ssize_t size, long depth, long family)
{
    size_t slot = ((size_t)depth * 1000003u ^ (size_t)family * 2654435761u) & (size - 1);
    while (table[slot].depth != -1 &&
           (table[slot].depth != depth || table[slot].family != family))
        slot = (slot + 1) & (size - 1);
    return slot;
}

/* A table of ``size`` empty slots (depth -1), or NULL (MemoryError). */
static GroupCount *new_counts(Py_ssize_t size)
{
    GroupCount *table = PyMem_Malloc(size * sizeof(GroupCount));
    if (table == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < size; i++) table[i].depth = -1;
    return table;
}

/* ``*table`` moved into one twice its ``*size``; -1 (MemoryError, the old
 * table kept) or 0. */
static int grow_counts(GroupCount **table, Py_ssize_t *size)
{
    GroupCount *grown = new_counts(2 * *size);
    if (grown == NULL) return -1;
    for (Py_ssize_t i = 0; i < *size; i++)
        if ((*table)[i].depth != -1)
            grown[count_slot(grown, 2 * *size, (*table)[i].depth, (*table)[i].family)] =
                (*table)[i];
    PyMem_Free(*table);
    *table = grown;
    *size *= 2;
    return 0;
}

static PyObject *count_groups(PyObject *self, PyObject *nodes)
{
    if (!configured || !PyList_Check(nodes)) {
        PyErr_SetString(PyExc_TypeError, "count_groups(list of nodes)");
        return NULL;
    }
    /* groups are few (a flush of a SICK minibatch of 256 has ~40): the
     * table starts small and doubles whenever it is half full */
    Py_ssize_t n = PyList_GET_SIZE(nodes), size = 128, filled = 0, alone = 0;
    PyObject *groups = NULL, *used = NULL;
    GroupCount *table = new_counts(size);
    if (table == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        if (Py_TYPE(node) != NodeType) {
            PyErr_SetString(PyExc_TypeError, "count_groups: not a Node");
            goto error;
        }
        SigInfo *info = sig_info(SLOT(node, n_sig));
        if (info == NULL) goto error;
        if (!info->safe) { alone++; continue; }
        PyObject *depth_obj = SLOT(node, n_depth);
        long depth = PyLong_AsLong(depth_obj), family = PyLong_AsLong(info->family);
        if (PyErr_Occurred()) goto error;
        size_t slot = count_slot(table, size, depth, family);
        if (table[slot].depth == -1 && ++filled > size / 2) {
            if (grow_counts(&table, &size)) goto error;
            slot = count_slot(table, size, depth, family);
        }
        GroupCount *entry = &table[slot];
        if (entry->depth == -1) {
            entry->depth = depth; entry->family = family;
            entry->depth_obj = depth_obj; entry->family_obj = info->family;
            entry->count = entry->used = 0;
        }
        entry->count++;
        if (SLOT(node, n_used) == Py_True) entry->used++;
    }
    groups = PyDict_New();
    used = PyDict_New();
    if (!groups || !used) goto error;
    for (Py_ssize_t i = 0; i < size; i++) {
        GroupCount *entry = &table[i];
        if (entry->depth == -1) continue;
        PyObject *key = PyTuple_Pack(2, entry->depth_obj, entry->family_obj);
        PyObject *count = key ? PyLong_FromSsize_t(entry->count) : NULL;
        int rc = count == NULL || PyDict_SetItem(groups, key, count);
        Py_XDECREF(count);
        if (!rc && entry->used) {
            count = PyLong_FromSsize_t(entry->used);
            rc = count == NULL || PyDict_SetItem(used, key, count);
            Py_XDECREF(count);
        }
        Py_XDECREF(key);
        if (rc) goto error;
    }
    PyMem_Free(table);
    return Py_BuildValue("(NNn)", groups, used, alone);
error:
    PyMem_Free(table);
    Py_XDECREF(groups); Py_XDECREF(used);
    return NULL;
}

/* ------------------------------------------------------- depth_groups */

/* One (depth, signature) group of depth_groups: its calls, in recording
 * order. */
typedef struct {
    long depth;                     /* the key, with sig; sig NULL: empty slot */
    PyObject *sig;
    PyObject *depth_obj, *family;   /* borrowed: the nodes keep them */
    PyObject *members;              /* new reference */
} DepthSig;

/* A family's deepest sink (a call no other call of the flush reads). */
typedef struct {
    long family, depth;             /* depth -1: empty slot */
    PyObject *depth_obj;            /* borrowed */
} SinkDepth;

static SinkDepth *sink_slot(SinkDepth *table, Py_ssize_t size, long family)
{
    size_t slot = ((size_t)family * 2654435761u) & (size - 1);
    while (table[slot].depth != -1 && table[slot].family != family)
        slot = (slot + 1) & (size - 1);
    return &table[slot];
}

static size_t depth_sig_slot(const DepthSig *table, Py_ssize_t size, long depth, PyObject *sig)
{
    size_t slot = ((size_t)depth * 1000003u ^ ((uintptr_t)sig >> 4) * 2654435761u) & (size - 1);
    while (table[slot].sig != NULL && (table[slot].sig != sig || table[slot].depth != depth))
        slot = (slot + 1) & (size - 1);
    return slot;
}

/* The tables start small and double whenever they are half full (a flush
 * of a SICK minibatch of 256 has ~100 groups and one family; a chain of
 * calls has a group per call).  -1: MemoryError, the old table kept. */
static int grow_sinks(SinkDepth **table, Py_ssize_t *size)
{
    SinkDepth *grown = PyMem_Malloc(2 * *size * sizeof(SinkDepth));
    if (grown == NULL) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < 2 * *size; i++) grown[i].depth = -1;
    for (Py_ssize_t i = 0; i < *size; i++)
        if ((*table)[i].depth != -1)
            *sink_slot(grown, 2 * *size, (*table)[i].family) = (*table)[i];
    PyMem_Free(*table);
    *table = grown;
    *size *= 2;
    return 0;
}

/* (``order`` lists the occupied slots in the order they were filled; it
 * is renumbered.) */
static int grow_depth_sigs(DepthSig **table, Py_ssize_t *size, Py_ssize_t *order,
                           Py_ssize_t n_groups)
{
    DepthSig *grown = PyMem_Malloc(2 * *size * sizeof(DepthSig));
    if (grown == NULL) { PyErr_NoMemory(); return -1; }
    for (Py_ssize_t i = 0; i < 2 * *size; i++) grown[i].sig = NULL;
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        DepthSig *old = &(*table)[order[g]];
        size_t slot = depth_sig_slot(grown, 2 * *size, old->depth, old->sig);
        grown[slot] = *old;
        order[g] = slot;
    }
    PyMem_Free(*table);
    *table = grown;
    *size *= 2;
    return 0;
}

/* plan.depth_groups_py in C: ({(depth, family): {sig: [nodes]}},
 * [(depth, family, node)] for calls that run alone), both in the order
 * their first call was recorded, as the Python version makes them.  The
 * groups are found in open-addressing tables keyed by C values (a family's
 * deepest sink; depth and signature), and Python's dicts are built once
 * per group at the end: a tuple key and two dict lookups per call had been
 * ~70 ns of the ~0.9 ms a SICK minibatch of 256 spent in analysis. */
static PyObject *depth_groups(PyObject *self, PyObject *nodes)
{
    if (!configured || !PyList_Check(nodes)) {
        PyErr_SetString(PyExc_TypeError, "depth_groups(list of nodes)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(nodes), size = 256, n_groups = 0, sink_size = 16,
               n_sinks = 0;
    DepthSig *table = PyMem_Malloc(size * sizeof(DepthSig));
    SinkDepth *sinks = PyMem_Malloc(sink_size * sizeof(SinkDepth));
    Py_ssize_t *order = PyMem_Malloc((n + 1) * sizeof(Py_ssize_t));
    PyObject *groups = NULL, *alone = NULL;
    if (table == NULL || sinks == NULL || order == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < size; i++) table[i].sig = NULL;
    for (Py_ssize_t i = 0; i < sink_size; i++) sinks[i].depth = -1;
    if ((groups = PyDict_New()) == NULL || (alone = PyList_New(0)) == NULL) goto error;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        if (Py_TYPE(node) != NodeType) {
            PyErr_SetString(PyExc_TypeError, "depth_groups: not a Node");
            goto error;
        }
        if (SLOT(node, n_used) == Py_True) continue;
        SigInfo *info = sig_info(SLOT(node, n_sig));
        if (info == NULL) goto error;
        if (!info->safe) continue;
        long family = PyLong_AsLong(info->family), depth = small_int(SLOT(node, n_depth));
        if (PyErr_Occurred()) goto error;
        SinkDepth *sink = sink_slot(sinks, sink_size, family);
        if (sink->depth == -1 && ++n_sinks > sink_size / 2) {
            if (grow_sinks(&sinks, &sink_size)) goto error;
            sink = sink_slot(sinks, sink_size, family);
        }
        if (sink->depth == -1 || depth > sink->depth) {
            sink->family = family;
            sink->depth = depth;
            sink->depth_obj = SLOT(node, n_depth);
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i), *sig = SLOT(node, n_sig);
        SigInfo *info = sig_info(sig);
        if (info == NULL) goto error;
        PyObject *depth_obj = SLOT(node, n_depth);
        if (!info->safe) {
            PyObject *entry = PyTuple_Pack(3, depth_obj, info->family, node);
            int rc = entry == NULL || PyList_Append(alone, entry);
            Py_XDECREF(entry);
            if (rc) goto error;
            continue;
        }
        long depth;
        if (SLOT(node, n_used) != Py_True) {
            long family = PyLong_AsLong(info->family);
            if (PyErr_Occurred()) goto error;
            SinkDepth *sink = sink_slot(sinks, sink_size, family);
            depth = sink->depth;
            depth_obj = sink->depth_obj;
        } else {
            depth = small_int(depth_obj);
            if (PyErr_Occurred()) goto error;
        }
        size_t slot = depth_sig_slot(table, size, depth, sig);
        if (table[slot].sig == NULL && n_groups + 1 > size / 2) {
            if (grow_depth_sigs(&table, &size, order, n_groups)) goto error;
            slot = depth_sig_slot(table, size, depth, sig);
        }
        DepthSig *group = &table[slot];
        if (group->sig == NULL) {
            PyObject *family_obj = info->family;    /* before PyList_New (a collection) */
            if ((group->members = PyList_New(0)) == NULL) goto error;
            group->sig = sig;
            group->depth = depth;
            group->depth_obj = depth_obj;
            group->family = family_obj;
            order[n_groups++] = slot;
        }
        if (PyList_Append(group->members, node)) goto error;
    }
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        DepthSig *group = &table[order[g]];
        PyObject *key = PyTuple_Pack(2, group->depth_obj, group->family);
        if (key == NULL) goto error;
        PyObject *by_sig = PyDict_GetItemWithError(groups, key);
        if (by_sig == NULL) {
            if (PyErr_Occurred() || (by_sig = PyDict_New()) == NULL) { Py_DECREF(key); goto error; }
            int rc = PyDict_SetItem(groups, key, by_sig);
            Py_DECREF(by_sig);                  /* groups holds it */
            if (rc) { Py_DECREF(key); goto error; }
        }
        Py_DECREF(key);
        if (PyDict_SetItem(by_sig, group->sig, group->members)) goto error;
    }
    for (Py_ssize_t g = 0; g < n_groups; g++)
        Py_CLEAR(table[order[g]].members);
    PyMem_Free(table); PyMem_Free(sinks); PyMem_Free(order);
    return Py_BuildValue("(NN)", groups, alone);
error:
    if (table != NULL && order != NULL)
        for (Py_ssize_t g = 0; g < n_groups; g++)
            Py_CLEAR(table[order[g]].members);
    PyMem_Free(table); PyMem_Free(sinks); PyMem_Free(order);
    Py_XDECREF(groups); Py_XDECREF(alone);
    return NULL;
}

/* ------------------------------------------------------- agenda_groups */

/* One signature family's side of the agenda: the average depth of its calls
 * (the priority) and its ready calls, ready[head:n] in the order they
 * became ready. */
typedef struct {
    long key;
    long long depth_sum;
    Py_ssize_t count, head, n, room;
    Py_ssize_t *ready;
} AgendaKey;

static int agenda_push(AgendaKey *k, Py_ssize_t node)
{
    if (k->n == k->room) {
        Py_ssize_t room = k->room ? 2 * k->room : 16;
        Py_ssize_t *grown = PyMem_Realloc(k->ready, room * sizeof(Py_ssize_t));
        if (grown == NULL) { PyErr_NoMemory(); return -1; }
        k->ready = grown;
        k->room = room;
    }
    k->ready[k->n++] = node;
    return 0;
}

/* Runs ``body`` once for each distinct pending node that node i reads,
 * with p its index in ``nodes`` (seen[p] == stamp: p met already for node
 * i).  A pending producer that is not at its ``pos`` in ``nodes``, before
 * node i, jumps to ``fallback`` (the caller runs the Python version). */
#define FOR_PRODUCERS(leaves, body)                                          \
    for (Py_ssize_t j = 0, n_leaves_ = PySequence_Fast_GET_SIZE(leaves);       \
         j < n_leaves_; j++) {                                               \
        PyObject *leaf = PySequence_Fast_ITEMS(leaves)[j];                   \
        if (Py_TYPE(leaf) != LazyValueType) continue;                        \
        PyObject *producer = SLOT(leaf, lv_node);                            \
        if (small_int(SLOT(producer, n_state)) != PENDING) continue;         \
        Py_ssize_t p = PyLong_AsSsize_t(SLOT(producer, n_pos));              \
        if (p < 0 || p >= i || PyList_GET_ITEM(nodes, p) != producer) {      \
            PyErr_Clear();                                                   \
            goto fallback;                                                   \
        }                                                                    \
        if (seen[p] == stamp) continue;                                      \
        seen[p] = stamp;                                                     \
        body                                                                 \
    }

/* plan.agenda_groups_py in C: the agenda's groups of nodes (tuples), in the
 * order they run; None for anything unusual (a node's leaves not a list, a
 * pending producer not in ``nodes`` at its ``pos``), which the Python
 * version then handles. */
static PyObject *agenda_groups(PyObject *self, PyObject *nodes)
{
    if (!configured || !PyList_Check(nodes)) {
        PyErr_SetString(PyExc_TypeError, "agenda_groups(list of nodes)");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(nodes), n_keys = 0, last = -1;
    Py_ssize_t *key_of = PyMem_Malloc((n + 1) * sizeof(Py_ssize_t));
    Py_ssize_t *waiting = PyMem_Calloc(n + 1, sizeof(Py_ssize_t));
    Py_ssize_t *starts = PyMem_Calloc(n + 2, sizeof(Py_ssize_t));
    Py_ssize_t *seen = PyMem_Malloc((n + 1) * sizeof(Py_ssize_t));
    Py_ssize_t *group = PyMem_Malloc((n + 1) * sizeof(Py_ssize_t));
    Py_ssize_t *users = NULL;
    AgendaKey *keys = PyMem_Calloc(n + 1, sizeof(AgendaKey));  /* at most one per node */
    PyObject *result = NULL;
    if (!key_of || !waiting || !starts || !seen || !group || !keys) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < n; i++) seen[i] = -1;
    /* pass 1: each node's family, its producers, how many users each has */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *node = PyList_GET_ITEM(nodes, i);
        if (Py_TYPE(node) != NodeType) {
            PyErr_SetString(PyExc_TypeError, "agenda_groups: not a Node");
            goto error;
        }
        /* anything unreadable (a signature without what the recorder
         * reads, a depth or key that is not a small int): Python's turn */
        SigInfo *info = sig_info(SLOT(node, n_sig));
        long key = info == NULL ? -1 : PyLong_AsLong(info->family);
        if (PyErr_Occurred()) {
            if (PyErr_ExceptionMatches(PyExc_MemoryError)) goto error;
            PyErr_Clear();
            goto fallback;
        }
        Py_ssize_t k = last;            /* consecutive calls often share a family */
        if (k < 0 || keys[k].key != key)
            for (k = 0; k < n_keys && keys[k].key != key; k++)
                ;
        if (k == n_keys) keys[n_keys++].key = key;
        last = key_of[i] = k;
        keys[k].depth_sum += small_int(SLOT(node, n_depth));
        keys[k].count++;
        PyObject *leaves = SLOT(node, n_leaves);
        if (!LEAVES_OK(leaves)) goto fallback;
        Py_ssize_t stamp = i;
        FOR_PRODUCERS(leaves, { waiting[i]++; starts[p + 1]++; })
        if (PyErr_Occurred()) {         /* a depth or state that is not an int */
            PyErr_Clear();
            goto fallback;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) starts[i + 1] += starts[i];
    users = PyMem_Malloc((starts[n] + 1) * sizeof(Py_ssize_t));
    if (users == NULL) { PyErr_NoMemory(); goto error; }
    /* pass 2: each producer's users, in recording order (group[] counts
     * how many are filled in so far) */
    memset(group, 0, (n + 1) * sizeof(Py_ssize_t));
    for (Py_ssize_t i = 0; i < n; i++) seen[i] = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *leaves = SLOT(PyList_GET_ITEM(nodes, i), n_leaves);
        Py_ssize_t stamp = i;
        FOR_PRODUCERS(leaves, { users[starts[p] + group[p]++] = i; })
        if (waiting[i] == 0 && agenda_push(&keys[key_of[i]], i)) goto error;
    }
    result = PyList_New(0);
    if (result == NULL) goto error;
    for (;;) {
        /* the family of lowest average depth among those with ready calls
         * (ties: the lower key), as min() over (depth_sum / count, key) */
        AgendaKey *best = NULL;
        double best_avg = 0.0;
        for (Py_ssize_t k = 0; k < n_keys; k++) {
            AgendaKey *c = &keys[k];
            if (c->head == c->n) continue;
            double avg = (double)c->depth_sum / (double)c->count;
            if (best == NULL || avg < best_avg || (avg == best_avg && c->key < best->key)) {
                best = c;
                best_avg = avg;
            }
        }
        if (best == NULL) break;
        Py_ssize_t size;
        if (best->key < 0) {            /* not batch-safe: one call, the rest stay */
            group[0] = best->ready[best->head++];
            size = 1;
        } else {
            size = best->n - best->head;
            memcpy(group, best->ready + best->head, size * sizeof(Py_ssize_t));
            best->head = best->n;
        }
        if (best->head == best->n) best->head = best->n = 0;
        PyObject *members = PyTuple_New(size);
        if (members == NULL) goto error;
        for (Py_ssize_t g = 0; g < size; g++)
            PyTuple_SET_ITEM(members, g, Py_NewRef(PyList_GET_ITEM(nodes, group[g])));
        int rc = PyList_Append(result, members);
        Py_DECREF(members);
        if (rc) goto error;
        for (Py_ssize_t g = 0; g < size; g++) {
            Py_ssize_t done = group[g];
            for (Py_ssize_t u = starts[done]; u < starts[done + 1]; u++)
                if (--waiting[users[u]] == 0 && agenda_push(&keys[key_of[users[u]]], users[u]))
                    goto error;
        }
    }
    goto done;
fallback:
    Py_CLEAR(result);
    result = Py_NewRef(Py_None);
    goto done;
error:
    Py_CLEAR(result);
done:
    if (keys != NULL)
        for (Py_ssize_t k = 0; k < n_keys; k++) PyMem_Free(keys[k].ready);
    PyMem_Free(keys); PyMem_Free(key_of); PyMem_Free(waiting); PyMem_Free(starts);
    PyMem_Free(seen); PyMem_Free(group); PyMem_Free(users);
    return result;
}
#undef FOR_PRODUCERS

/* ----------------------------------------------------- wrap_host
 *
 * Under a threaded engine a host array (token ids, a gather index) becomes
 * an NDArray over the numpy array's own memory, through MXNet's DLPack
 * import (execute.to_device; a copy would wait for every op queued on the
 * worker).  mx.nd.from_numpy builds the DLPack structures with ctypes,
 * ~18 us an array, tens of times per flush; this builds them in C.  The
 * NDArray holds a reference to the numpy array until MXNet frees it. */
typedef struct { int32_t device_type; int32_t device_id; } DLContextC;
typedef struct { uint8_t code; uint8_t bits; uint16_t lanes; } DLDataTypeC;
typedef struct {
    void *data;
    DLContextC ctx;
    int32_t ndim;
    DLDataTypeC dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensorC;
typedef struct DLManagedTensorC {
    DLTensorC dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorC *self);
} DLManagedTensorC;
typedef int (*FromDLPack)(DLManagedTensorC *, _Bool, void **);
static FromDLPack from_dlpack = NULL;
static PyThread_type_lock freed_lock = NULL;
static PyObject **freed = NULL;
static Py_ssize_t freed_count = 0, freed_room = 0;

static PyObject *set_from_dlpack(PyObject *self, PyObject *address)
{
    void *fn = address == Py_None ? NULL : PyLong_AsVoidPtr(address);
    if (fn == NULL && PyErr_Occurred()) return NULL;
    if (freed_lock == NULL && (freed_lock = PyThread_allocate_lock()) == NULL)
        return PyErr_NoMemory();
    from_dlpack = (FromDLPack)fn;
    Py_RETURN_NONE;
}

/* MXNet frees an array on whichever thread drops it last, often the
 * engine's worker.  Taking the GIL there would stall the worker while
 * Python runs (up to the 5 ms switch interval), so the deleter only
 * queues the numpy array, under a lock of its own, and the next wrap_host
 * (which holds the GIL) releases what was queued. */
static void host_deleter(DLManagedTensorC *self)
{
    PyObject *array = (PyObject *)self->manager_ctx;
    PyMem_RawFree(self);
    PyThread_acquire_lock(freed_lock, WAIT_LOCK);
    if (freed_count == freed_room) {
        Py_ssize_t room = freed_room ? 2 * freed_room : 256;
        PyObject **grown = PyMem_RawRealloc(freed, room * sizeof(PyObject *));
        if (grown != NULL) {
            freed = grown;
            freed_room = room;
        }
    }
    if (freed_count < freed_room)
        freed[freed_count++] = array;       /* (out of memory: leaked) */
    PyThread_release_lock(freed_lock);
}

static void release_freed(void)     /* with the GIL */
{
    PyThread_acquire_lock(freed_lock, WAIT_LOCK);
    PyObject **queued = freed;
    Py_ssize_t count = freed_count;
    freed = NULL;
    freed_count = freed_room = 0;
    PyThread_release_lock(freed_lock);
    for (Py_ssize_t i = 0; i < count; i++)
        Py_DECREF(queued[i]);
    PyMem_RawFree(queued);
}

/* DLPack type of a buffer format ('f', 'i', ... with its item size). */
static int dlpack_type(const char *format, Py_ssize_t itemsize, DLDataTypeC *type)
{
    if (format == NULL || format[0] == '\0' || format[1] != '\0') return 0;
    switch (format[0]) {
    case 'f': case 'd': case 'e': type->code = 2; break;                  /* float */
    case 'b': case 'i': case 'l': case 'q': type->code = 0; break;         /* int */
    case 'B': type->code = 1; break;                                      /* uint8 */
    default: return 0;
    }
    type->bits = (uint8_t)(8 * itemsize);
    type->lanes = 1;
    return 1;
}

/* wrap_host(array): the address of a new NDArray handle on cpu(0) over a
 * C-contiguous numpy array's memory, or None (another layout or type, an
 * empty array, no DLPack import known) for the caller's Python path. */
static PyObject *wrap_host(PyObject *self, PyObject *array)
{
    Py_buffer view;
    if (from_dlpack == NULL || Py_TYPE(array) != NumpyType) Py_RETURN_NONE;
    if (freed_count) release_freed();   /* a racy read: a miss waits for the next call */
    if (PyObject_GetBuffer(array, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    DLDataTypeC type;
    if (view.ndim < 1 || view.len == 0 || view.shape == NULL
        || !dlpack_type(view.format, view.itemsize, &type)) {
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    DLManagedTensorC *managed = PyMem_RawMalloc(sizeof(DLManagedTensorC)
                                                + view.ndim * sizeof(int64_t));
    if (managed == NULL) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    int64_t *shape = (int64_t *)(managed + 1);
    for (int i = 0; i < view.ndim; i++) shape[i] = view.shape[i];
    managed->dl_tensor.data = view.buf;
    managed->dl_tensor.ctx.device_type = 1;      /* kDLCPU */
    managed->dl_tensor.ctx.device_id = 0;
    managed->dl_tensor.ndim = view.ndim;
    managed->dl_tensor.dtype = type;
    managed->dl_tensor.shape = shape;
    managed->dl_tensor.strides = NULL;            /* compact, row-major */
    managed->dl_tensor.byte_offset = 0;
    managed->manager_ctx = array;
    managed->deleter = host_deleter;
    PyBuffer_Release(&view);      /* the reference below keeps the memory */
    Py_INCREF(array);
    void *handle = NULL;
    if (from_dlpack(managed, 0, &handle) != 0 || handle == NULL) {
        Py_DECREF(array);
        PyMem_RawFree(managed);
        Py_RETURN_NONE;     /* the Python path will raise MXNet's error */
    }
    return PyLong_FromVoidPtr(handle);
}

/* ------------------------------------------------------------- markers */
/* A pipelined scope flushes its next part once MXNet's engine has run the
 * part before (block.BatchingScope.pipeline).  MXNet 1.9 cannot ask
 * whether an array is ready without waiting for it, so the scope pushes a
 * *marker*: an engine operation that reads the part's last outputs and
 * only sets a flag.  The flag lives in a block that the job and the Python
 * capsule share; whichever lets go last frees it. */
typedef void (*SyncFunc)(void *, void *);
typedef void (*Deleter)(void *);
typedef int (*PushSyncND)(SyncFunc, void *, Deleter, const void *, void **, int, void **, int,
                          void *, int, const char *);
typedef struct { int refs; int done; } Marker;
static PushSyncND push_sync = NULL;
static const char marker_name[] = "gluon_dynbatch.marker";

static void marker_release(void *param)
{
    Marker *marker = (Marker *)param;
    if (__atomic_sub_fetch(&marker->refs, 1, __ATOMIC_ACQ_REL) == 0)
        free(marker);
}

static void marker_run(void *run_context, void *param)
{
    (void)run_context;
    __atomic_store_n(&((Marker *)param)->done, 1, __ATOMIC_RELEASE);
}

static void marker_capsule_free(PyObject *capsule)
{
    marker_release(PyCapsule_GetPointer(capsule, marker_name));
}

/* set_autograd_state(address of MXAutogradIsRecording, of MXAutogradIsTraining):
 * without them every call is recorded by the Python version */
static PyObject *set_autograd_state(PyObject *self, PyObject *args)
{
    PyObject *recording, *training;
    if (!PyArg_ParseTuple(args, "OO", &recording, &training)) return NULL;
    void *rec = recording == Py_None ? NULL : PyLong_AsVoidPtr(recording);
    if (rec == NULL && PyErr_Occurred()) return NULL;
    void *train = training == Py_None ? NULL : PyLong_AsVoidPtr(training);
    if (train == NULL && PyErr_Occurred()) return NULL;
    is_recording_fn = (AutogradFlag)rec;
    is_training_fn = (AutogradFlag)train;
#ifndef _WIN32
    flags_generation++;         /* each thread's look-up checks against them */
#endif
    Py_RETURN_NONE;
}

/* set_autograd_flags(path of libmxnet, address of MXAutogradSetIsRecording,
 * of MXAutogradSetIsTraining): look MXNet's autograd flags up to read them
 * in place (autograd_flags); the path None: ask the API. */
static PyObject *set_autograd_flags(PyObject *self, PyObject *args)
{
    PyObject *path, *recording, *training;
    if (!PyArg_ParseTuple(args, "OOO", &path, &recording, &training)) return NULL;
    void *rec = recording == Py_None ? NULL : PyLong_AsVoidPtr(recording);
    if (rec == NULL && PyErr_Occurred()) return NULL;
    void *train = training == Py_None ? NULL : PyLong_AsVoidPtr(training);
    if (train == NULL && PyErr_Occurred()) return NULL;
#ifndef _WIN32
    void *handle = NULL;
    if (path != Py_None) {
        PyObject *bytes = PyUnicode_EncodeFSDefault(path);
        if (bytes == NULL) return NULL;
        /* the library Python loaded: a handle to it, nothing loaded anew */
        handle = dlopen(PyBytes_AS_STRING(bytes), RTLD_LAZY | RTLD_NOLOAD);
        Py_DECREF(bytes);
    }
    if (mxnet_handle != NULL)
        dlclose(mxnet_handle);          /* (the library stays: Python holds it) */
    mxnet_handle = handle;
    set_recording_fn = (AutogradSetFlag)rec;
    set_training_fn = (AutogradSetFlag)train;
    flags_generation++;
    bool recording_now, training_now;
    if (autograd_flags(&recording_now, &training_now) != 0) Py_RETURN_FALSE;
    return PyBool_FromLong(flags_checked > 0);
#else
    Py_RETURN_FALSE;
#endif
}

/* autograd_flags(): (recording, training, read in place) for the calling
 * thread, as the recorder reads them; None if it cannot. */
static PyObject *py_autograd_flags(PyObject *self, PyObject *unused)
{
    bool recording, training;
    if (autograd_flags(&recording, &training) != 0) Py_RETURN_NONE;
#ifndef _WIN32
    int in_place = flags_checked > 0;
#else
    int in_place = 0;
#endif
    return Py_BuildValue("(OOO)", recording ? Py_True : Py_False,
                         training ? Py_True : Py_False, in_place ? Py_True : Py_False);
}

static PyObject *set_engine_push(PyObject *self, PyObject *address)
{
    void *fn = address == Py_None ? NULL : PyLong_AsVoidPtr(address);
    if (fn == NULL && PyErr_Occurred()) return NULL;
    push_sync = (PushSyncND)fn;
    Py_RETURN_NONE;
}

/* push_marker(handles, dev_type, dev_id): a capsule whose flag the engine
 * sets once the arrays (addresses of NDArray handles) are ready, or None
 * (no engine push known, or MXNet refused). */
static PyObject *push_marker(PyObject *self, PyObject *args)
{
    PyObject *handles;
    int dev_type, dev_id;
    if (!PyArg_ParseTuple(args, "Oii", &handles, &dev_type, &dev_id)) return NULL;
    if (push_sync == NULL) Py_RETURN_NONE;
    PyObject *seq = PySequence_Fast(handles, "push_marker: handles must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    void **reads = PyMem_Malloc((count ? count : 1) * sizeof(void *));
    Marker *marker = malloc(sizeof(Marker));
    if (reads == NULL || marker == NULL) {
        PyMem_Free(reads);
        free(marker);
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++)
        reads[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(seq, i));
    Py_DECREF(seq);
    if (PyErr_Occurred()) {
        PyMem_Free(reads);
        free(marker);
        return NULL;
    }
    marker->refs = 2;       /* the job's and the capsule's */
    marker->done = 0;
    PyObject *capsule = PyCapsule_New(marker, marker_name, marker_capsule_free);
    if (capsule == NULL) {
        PyMem_Free(reads);
        free(marker);
        return NULL;
    }
    const struct { int32_t dev_type; int32_t dev_id; } context = {dev_type, dev_id};
    int failed = push_sync(marker_run, marker, marker_release, &context, reads, (int)count,
                           NULL, 0, NULL, 0, "gluon_dynbatch_marker");
    PyMem_Free(reads);
    if (failed) {
        /* MXNet may or may not have released the job's share: leave it (a
         * few bytes at worst) and let the caller flush as if none existed */
        Py_DECREF(capsule);
        Py_RETURN_NONE;
    }
    return capsule;
}

/* marker_done(capsule): whether the engine has run the marker. */
static PyObject *marker_done(PyObject *self, PyObject *capsule)
{
    Marker *marker = PyCapsule_GetPointer(capsule, marker_name);
    if (marker == NULL) return NULL;
    return PyBool_FromLong(__atomic_load_n(&marker->done, __ATOMIC_ACQUIRE));
}

/* ------------------------------------------------------------- module */

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS,
     "configure(LazyValue, Node, NDArray, numpy.ndarray, current_context, Context._default_ctx, "
     "lazy_results, zeros, numpy.empty((2, 3, 5))) -> whether numpy fields are read directly"},
    {"record", (PyCFunction)(void (*)(void))record, METH_FASTCALL,
     "record(scope, dblock, args): lazy result(s), or None to run the Python version"},
    {"structure_key", structure_key, METH_O, "structure_key(nodes): see plan.structure_key"},
    {"gather_index", gather_index, METH_VARARGS,
     "gather_index(leaves, ZeroRow): (distinct arrays, int32 row bytes or None) or None"},
    {"set_shape_reader", set_shape_reader, METH_VARARGS,
     "set_shape_reader(address of MXNDArrayGetShapeEx[64] or None, is_64)"},
    {"set_ndarray_readers", set_ndarray_readers, METH_VARARGS,
     "set_ndarray_readers(address of MXNDArrayGetDType or None, of MXNDArrayGetContext or None, "
     "_DTYPE_MX_TO_NP, Context, NDArray subclasses read as NDArray)"},
    {"gather_item", gather_item, METH_VARARGS,
     "gather_item(nodes, span_of, width, zero or None, ZeroRow, compact=False): "
     "(parts, index, lengths) "
     "as gather_index, with each node's list length (int32 bytes, None when none is short); "
     "or None"},
    {"call_method", call_method, METH_VARARGS,
     "call_method(DynBatchBlock, thread-local holding .scope, python_call(dblock, args), "
     "BatchingScope)"},
    {"host_rows", host_rows, METH_O, "host_rows(numpy leaves): their bytes concatenated, or None"},
    {"host_item", host_item, METH_VARARGS,
     "host_item(nodes, span_of): host_rows of one argument of every node, or None"},
    {"finish_nodes", finish_nodes, METH_VARARGS,
     "finish_nodes(nodes, arrays, rows=None): see execute.finish_nodes_py"},
    {"count_groups", count_groups, METH_O, "count_groups(nodes): see plan.count_groups_py"},
    {"depth_groups", depth_groups, METH_O, "depth_groups(nodes): see plan.depth_groups_py"},
    {"agenda_groups", agenda_groups, METH_O,
     "agenda_groups(nodes): see plan.agenda_groups_py; None for the unusual case"},
    {"set_from_dlpack", set_from_dlpack, METH_O,
     "set_from_dlpack(address of MXNDArrayFromDLPackEx or None)"},
    {"wrap_host", wrap_host, METH_O,
     "wrap_host(numpy array): address of a new NDArray handle over its memory, or None"},
    {"set_autograd_state", set_autograd_state, METH_VARARGS,
     "set_autograd_state(address of MXAutogradIsRecording, of MXAutogradIsTraining)"},
    {"set_autograd_flags", set_autograd_flags, METH_VARARGS,
     "set_autograd_flags(path of libmxnet, address of MXAutogradSetIsRecording, "
     "of MXAutogradSetIsTraining) -> whether this thread reads MXNet's flags in place"},
    {"autograd_flags", py_autograd_flags, METH_NOARGS,
     "autograd_flags() -> (recording, training, read in place) as the recorder reads them"},
    {"set_engine_push", set_engine_push, METH_O,
     "set_engine_push(address of MXEnginePushSyncND or None)"},
    {"push_marker", push_marker, METH_VARARGS,
     "push_marker(NDArray handle addresses, dev_type, dev_id): a marker the engine sets once "
     "they are ready, or None"},
    {"marker_done", marker_done, METH_O, "marker_done(marker): whether the engine ran it"},
    {"memo_clear", memo_clear, METH_NOARGS, "memo_clear(): forget every memoized signature"},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_speedups", "C fast paths of gluon_dynbatch (see accel.py).", -1,
    methods
};

#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL

/* Bumped whenever a function's arguments or results change meaning
 * (accel.ABI must match, else the pure-Python path runs): an extension
 * built from older sources would otherwise still load, and fail. */
#define ABI 10

PyMODINIT_FUNC PyInit__speedups(void)
{
    INTERN(s_out_info, "out_info"); INTERN(s_batch_safe, "batch_safe");
    INTERN(s_group_key, "group_key"); INTERN(s_out_fmt, "out_fmt");
    INTERN(s_signatures, "_signatures");
    INTERN(s_trace, "_trace"); INTERN(s_pending, "pending");
    INTERN(s_flush_at, "flush_at"); INTERN(s_pipeline, "pipeline");
    INTERN(s_tape, "tape"); INTERN(s_repeatable, "repeatable");
    INTERN(s_passthrough, "passthrough"); INTERN(s_grad, "grad");
    INTERN(s_inference, "inference");
    INTERN(s_itemsize, "itemsize"); INTERN(s_isnative, "isnative");
    INTERN(s_shape, "shape"); INTERN(s_dtype, "dtype"); INTERN(s_type, "type");
    INTERN(s_context, "context"); INTERN(s_device_typeid, "device_typeid");
    INTERN(s_device_id, "device_id"); INTERN(s_sig_id, "sig_id"); INTERN(s_arrays, "arrays");
    INTERN(s_value, "value"); INTERN(s___dict__, "__dict__"); INTERN(s_scope, "scope");
    INTERN(s_handle, "handle");
    start_ticks();
    int_zero = PyLong_FromLong(0);
    int_one = PyLong_FromLong(1);
    pair_fmt = Py_BuildValue("(ii)", 0, 0);
    leaf_classes = PyDict_New();
    if (!int_zero || !int_one || !pair_fmt || !leaf_classes || PyType_Ready(&TapeType) < 0
        || PyType_Ready(&ScopeSlotType) < 0)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && (PyModule_AddObjectRef(mod, "Tape", (PyObject *)&TapeType) < 0
                        || PyModule_AddObjectRef(mod, "ScopeSlot",
                                                 (PyObject *)&ScopeSlotType) < 0
                        || PyModule_AddIntConstant(mod, "ABI", ABI) < 0))
        Py_CLEAR(mod);
    return mod;
}
