/* AdaGrad's update of one dense float32 CPU parameter, as one operation on
 * MXNet's engine (see optim.py, FusedAdaGrad).
 *
 * MXNet's own kernel (sparse.adagrad_update) computes a square root per
 * element through a scalar call, ~4 ns an element here, and a dense
 * gradient must first be cast to row-sparse (another pass, and an op).
 * This loop does the same arithmetic in the same order, in float32, over
 * the rows of the dense gradient that hold a non-zero (the rows the cast
 * would keep), and the compiler vectorises the square roots.
 *
 * The work is pushed with MXEnginePushSyncND (whose address the Python side
 * gives to set_engine): the engine runs it after the ops that write the
 * gradient and before any later op that reads the weight or the history,
 * on its worker thread, without the GIL (the job touches no Python object).
 * The data addresses are read when the job is pushed, and only once no op
 * is pending: the call first waits for every op pushed so far
 * (MXNDArrayWaitAll, GIL released).  MXNet allocates an op's output when
 * the op runs, so MXNDArrayGetData on an array whose op is in flight (a
 * Trainer's first step makes AdaGrad's history with zeros) allocates it
 * from this thread too: in ~14% of 20,000 tries the address read was not
 * the array's final buffer, and an update there read garbage (NaN weights
 * and histories in loaded SICK training runs).  The call also reads the
 * array's MKLDNN state, which an op in flight may be changing (an inference
 * Convolution reorders its weight in place).  After the wait only ops
 * pushed after the job touch the arrays, and the engine runs them after
 * it; an NDArray's memory is released only through the engine, after
 * every op pushed on it, so the addresses stay valid until the job has
 * run.  update_many pushes a Trainer step's updates after one wait, which
 * ends when the backward pass does (waiting per array and per update cost
 * 6-11% of a SICK training step).
 *
 * That wait keeps the Python thread from running ahead into the next
 * minibatch while the engine's worker finishes the backward pass, so
 * where it can, an update reads the addresses *in the job* instead
 * (update_many_async): the engine runs the job only once every op pushed
 * before it on the three arrays has run and none can start, so nothing is
 * in flight on them, MXNDArrayGetData allocates a delay-allocated array
 * as the op that writes it would, and the addresses are final.  Two
 * things stand in the way, and set_chunk_reader checks both:
 *   - MXNDArrayGetData on an array MKLDNN holds in a layout of its own (an
 *     inference FullyConnected or Convolution may reorder its weight in
 *     place) pushes a reorder and waits for it: inside the job, which holds
 *     the array, that wait never ends.  So the job first turns the weight
 *     and the gradient back to the default layout itself, with what that
 *     reorder runs, NDArray::Chunk::Reorder2Default() (an exported symbol
 *     of libmxnet; a no-op for an array in the default layout), on the
 *     chunk the NDArray's first field points to (its shared_ptr<Chunk>).
 *     That layout is checked on a probe array when the reader is set: the
 *     chunk's first field, its storage handle's address, must be the
 *     array's data address, for the array and for a row of it.
 *   - The handles Python passes may be freed before the job runs, so the
 *     job holds detached copies of them (MXNDArrayDetach: same storage,
 *     same engine variable), freed after it has run.
 * The gradient is pushed as written, not only read: its layout may change.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "_pycompat.h"
#include <stdint.h>
#include <stdlib.h>

typedef void (*SyncFunc)(void *, void *);
typedef void (*Deleter)(void *);
typedef int (*PushSyncND)(SyncFunc, void *, Deleter, const void *, void **, int, void **, int,
                          void *, int, const char *);
typedef int (*GetData)(void *, void **);
typedef int (*WaitAll)(void);
typedef int (*GetShape32)(void *, int *, const int **);
typedef int (*GetShape64)(void *, int *, const int64_t **);
typedef int (*GetInt)(void *, int *);
typedef int (*GetContext)(void *, int *, int *);
typedef int (*Detach)(void *, void **);
typedef int (*Free)(void *);
typedef void (*ChunkReorder)(void *);

static PushSyncND push_sync = NULL;
static GetData get_data = NULL;
static WaitAll wait_all = NULL;
static void *get_shape = NULL;
static int shape_64 = 0;
static GetInt get_dtype = NULL, get_stype = NULL;
static GetContext get_context = NULL;
/* the in-job path (update_many_async); NULL until set_chunk_reader
 * accepts them */
static Detach detach = NULL;
static Free free_array = NULL;
static ChunkReorder chunk_reorder = NULL;
static int in_job_ready = 0;

/* mxnet::Context, as the engine reads it through a ContextHandle */
static const struct { int dev_type; int32_t dev_id; } cpu_context = {1, 0};

typedef struct {
    float *weight, *history;
    const float *grad;
    int64_t rows, cols;
    float lr, eps, rescale, clip, decay;   /* clip < 0: none; decay 1: no weight decay */
    void *handles[3];   /* in-job path: detached weight, gradient, history; else NULL */
} Job;

/* One row, in the order of MXNet's AdagradDnsRspDnsKernel<cpu>: rescale,
 * clip, history += g*g, weight -= (g / sqrt(history + eps)) * lr. */
static void update_row(float *restrict w, float *restrict h, const float *restrict g,
                       int64_t cols, float lr, float eps, float rescale, float clip)
{
    if (clip >= 0.0f) {
        for (int64_t j = 0; j < cols; j++) {
            float x = g[j] * rescale;
            x = x > clip ? clip : (x < -clip ? -clip : x);
            h[j] += x * x;
            w[j] = w[j] - (x / __builtin_sqrtf(h[j] + eps)) * lr;
        }
    } else {
        for (int64_t j = 0; j < cols; j++) {
            float x = g[j] * rescale;
            h[j] += x * x;
            w[j] = w[j] - (x / __builtin_sqrtf(h[j] + eps)) * lr;
        }
    }
}

/* Whether a row holds an element != 0 (NaN included, -0 not): its bits
 * without the sign, or-ed, a loop the compiler vectorises (a dense
 * embedding gradient is mostly zero rows, all scanned). */
typedef uint32_t __attribute__((may_alias)) word;

static int nonzero(const float *row, int64_t cols)
{
    const word *bits = (const word *)row;
    word any = 0;
    for (int64_t j = 0; j < cols; j++)
        any |= bits[j] & 0x7fffffffu;
    return any != 0;
}

static void update_rows(const Job *job)
{
    const int64_t cols = job->cols;
    for (int64_t r = 0; r < job->rows; r++) {
        float *w = job->weight + r * cols, *h = job->history + r * cols;
        const float *g = job->grad + r * cols;
        if (job->decay != 1.0f)
            for (int64_t j = 0; j < cols; j++)
                w[j] = w[j] * job->decay;
        if (nonzero(g, cols))    /* the rows a cast to row-sparse keeps */
            update_row(w, h, g, cols, job->lr, job->eps, job->rescale, job->clip);
    }
}

/* The job of update_many: addresses read before the push. */
static void run_job(void *run_context, void *param)
{
    update_rows((const Job *)param);
}

/* The job of update_many_async: addresses read here, where no op is in
 * flight on the arrays (see the top of this file).  A failure leaves the
 * arrays as they were and is counted (failed_jobs), for the Python side to
 * raise at its next call: it cannot happen once set_chunk_reader has
 * accepted the reader, short of MXNet running out of memory. */
static volatile long failed_jobs = 0;

static void *chunk_of(void *handle)
{
    return *(void **)handle;        /* NDArray's first field: shared_ptr<Chunk> */
}

static void run_job_in_place(void *run_context, void *param)
{
    Job *job = (Job *)param;
    void *w_data = NULL, *g_data = NULL, *h_data = NULL;
    if (chunk_reorder != NULL) {        /* MXNet built with MKLDNN */
        chunk_reorder(chunk_of(job->handles[0]));
        chunk_reorder(chunk_of(job->handles[1]));
    }
    if (get_data(job->handles[0], &w_data) || get_data(job->handles[1], &g_data)
        || get_data(job->handles[2], &h_data) || !w_data || !g_data || !h_data) {
        __atomic_add_fetch(&failed_jobs, 1, __ATOMIC_SEQ_CST);
        return;
    }
    job->weight = w_data;
    job->grad = g_data;
    job->history = h_data;
    update_rows(job);
}

static void free_job(void *param)
{
    Job *job = (Job *)param;
    for (int i = 0; i < 3; i++)
        if (job->handles[i] != NULL)
            free_array(job->handles[i]);
    free(job);
}

static PyObject *set_engine(PyObject *self, PyObject *args)
{
    PyObject *push, *data, *wait, *shape, *dtype, *stype, *context;
    int is_64;
    if (!PyArg_ParseTuple(args, "OOOOOOOp", &push, &data, &wait, &shape, &dtype, &stype,
                          &context, &is_64))
        return NULL;
    push_sync = (PushSyncND)PyLong_AsVoidPtr(push);
    get_data = (GetData)PyLong_AsVoidPtr(data);
    wait_all = (WaitAll)PyLong_AsVoidPtr(wait);
    get_shape = PyLong_AsVoidPtr(shape);
    get_dtype = (GetInt)PyLong_AsVoidPtr(dtype);
    get_stype = (GetInt)PyLong_AsVoidPtr(stype);
    get_context = (GetContext)PyLong_AsVoidPtr(context);
    shape_64 = is_64;
    if (PyErr_Occurred()) {
        push_sync = NULL;
        return NULL;
    }
    Py_RETURN_NONE;
}

/* Elements of the array at ``handle``, and its leading dimension; -1 if
 * MXNet cannot tell or it is not a dense (storage type 0) float32 (dtype
 * 0) array on the CPU (device type 1). */
static int64_t float_elements(void *handle, int64_t *rows)
{
    int ndim = -1, dtype = -1, stype = -1, device = -1, device_id = -1;
    int64_t size = 1;
    if (get_stype(handle, &stype) != 0 || stype != 0 || get_dtype(handle, &dtype) != 0
        || dtype != 0 || get_context(handle, &device, &device_id) != 0 || device != 1)
        return -1;
    if (shape_64) {
        const int64_t *dims;
        if (((GetShape64)get_shape)(handle, &ndim, &dims) != 0 || ndim < 1) return -1;
        for (int i = 0; i < ndim; i++) size *= dims[i];
        *rows = dims[0];
    } else {
        const int *dims;
        if (((GetShape32)get_shape)(handle, &ndim, &dims) != 0 || ndim < 1) return -1;
        for (int i = 0; i < ndim; i++) size *= dims[i];
        *rows = dims[0];
    }
    return size;
}

/* One update to push: the three NDArray handles and the hyperparameters. */
typedef struct {
    void *weight, *grad, *history;
    double lr, eps, rescale, clip, decay;
} Request;

static int parse_request(PyObject *args, Request *r)
{
    unsigned long long w, g, h;
    if (!PyArg_ParseTuple(args, "KKKddddd", &w, &g, &h, &r->lr, &r->eps, &r->rescale,
                          &r->clip, &r->decay))
        return 0;
    r->weight = (void *)(uintptr_t)w;
    r->grad = (void *)(uintptr_t)g;
    r->history = (void *)(uintptr_t)h;
    return 1;
}

/* The elements of a request's arrays, and their rows, when they are three
 * dense float32 CPU arrays of one shape; else 0. */
static int64_t request_size(const Request *r, int64_t *rows)
{
    int64_t g_rows, h_rows;
    int64_t size = float_elements(r->weight, rows);
    if (size <= 0 || *rows <= 0 || float_elements(r->grad, &g_rows) != size || g_rows != *rows
        || float_elements(r->history, &h_rows) != size || h_rows != *rows)
        return 0;
    return size;
}

/* Push one update, without the GIL, once no op is pending: 1 if pushed, 0
 * if the arrays are not three dense float32 CPU arrays of one shape (or
 * MXNet refused), -1 out of memory. */
static int push_update(const Request *r)
{
    int64_t rows;
    int64_t size = request_size(r, &rows);
    if (size == 0)
        return 0;
    void *w_data = NULL, *g_data = NULL, *h_data = NULL;
    if (get_data(r->weight, &w_data) || get_data(r->grad, &g_data)
        || get_data(r->history, &h_data) || !w_data || !g_data || !h_data)
        return 0;
    Job *job = malloc(sizeof(Job));
    if (job == NULL)
        return -1;
    *job = (Job){w_data, h_data, g_data, rows, size / rows, (float)r->lr, (float)r->eps,
                 (float)r->rescale, (float)r->clip, (float)r->decay, {NULL, NULL, NULL}};
    void *reads[1] = {r->grad}, *writes[2] = {r->weight, r->history};
    if (push_sync(run_job, job, free, &cpu_context, reads, 1, writes, 2, NULL, 0,
                  "gluon_dynbatch_adagrad") != 0)
        /* not run; MXNet may or may not have freed the job already, so it
         * is left (a few bytes), and MXNet's path will raise the error */
        return 0;
    return 1;
}

/* Wait until every op pushed so far has run, then push each request;
 * pushed[i] as push_update says.  The GIL is released throughout: pending
 * ops may need it (Python custom ops), and MXNDArrayGetData may wait.
 * -1: out of memory; -2: the wait failed (an op before raised: MXNet's
 * last error says what, and it must reach the user, since WaitAll has
 * cleared it); nothing is pushed then. */
static int push_all(const Request *requests, int *pushed, Py_ssize_t count)
{
    int failed, out_of_memory = 0;
    Py_BEGIN_ALLOW_THREADS
    failed = wait_all();
    for (Py_ssize_t i = 0; i < count; i++) {
        pushed[i] = failed ? 0 : push_update(&requests[i]);
        if (pushed[i] < 0) {
            pushed[i] = 0;
            out_of_memory = 1;
        }
    }
    Py_END_ALLOW_THREADS
    return failed ? -2 : out_of_memory ? -1 : 0;
}

/* Push one update whose job reads the addresses itself: 1 if pushed, 0
 * as push_update, -1 out of memory.  Nothing here waits. */
static int push_update_in_job(const Request *r)
{
    int64_t rows;
    int64_t size = request_size(r, &rows);
    if (size == 0)
        return 0;
    Job *job = calloc(1, sizeof(Job));
    if (job == NULL)
        return -1;
    *job = (Job){NULL, NULL, NULL, rows, size / rows, (float)r->lr, (float)r->eps,
                 (float)r->rescale, (float)r->clip, (float)r->decay, {NULL, NULL, NULL}};
    void *given[3] = {r->weight, r->grad, r->history};
    for (int i = 0; i < 3; i++) {
        if (detach(given[i], &job->handles[i]) != 0 || job->handles[i] == NULL) {
            free_job(job);
            return 0;
        }
    }
    void *writes[3] = {r->weight, r->grad, r->history};
    if (push_sync(run_job_in_place, job, free_job, &cpu_context, NULL, 0, writes, 3, NULL, 0,
                  "gluon_dynbatch_adagrad") != 0)
        return 0;       /* as in push_update: the job is left to MXNet */
    return 1;
}

/* update_many(sequence of requests, each a tuple (weight, grad, history
 * handles as ints, lr, eps, rescale, clip, decay)): a list of whether each
 * was pushed (False when the arrays are not three dense float32 arrays of
 * one shape: the caller then takes MXNet's path), or None when waiting for
 * the ops before failed (the caller raises MXNet's last error).  One wait
 * serves them all: a Trainer step's updates, each waiting on its own,
 * waited for the one pushed before it. */
static PyObject *update_many(PyObject *self, PyObject *requests)
{
    PyObject *seq = PySequence_Fast(requests, "update_many takes a sequence of tuples");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    Request *parsed = PyMem_Malloc((count ? count : 1) * sizeof(Request));
    int *pushed = PyMem_Malloc((count ? count : 1) * sizeof(int));
    PyObject *result = NULL;
    if (parsed == NULL || pushed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "update_many takes a sequence of tuples");
            goto done;
        }
        if (!parse_request(item, &parsed[i]))
            goto done;
        pushed[i] = 0;
    }
    int rc = push_sync != NULL && count ? push_all(parsed, pushed, count) : 0;
    if (rc == -2) {                 /* the caller raises MXNet's last error */
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (rc < 0) {
        PyErr_NoMemory();
        goto done;
    }
    result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++)
        PyList_SET_ITEM(result, i, PyBool_FromLong(pushed[i]));
done:
    PyMem_Free(parsed);
    PyMem_Free(pushed);
    Py_DECREF(seq);
    return result;
}

/* set_chunk_reader(addresses of MXNDArrayDetach, MXNDArrayFree,
 * NDArray::Chunk::Reorder2Default or 0 when MXNet is built without MKLDNN,
 * a probe NDArray handle, a handle of its second row): whether the in-job
 * path is usable; the probe must have no op pending. */
static PyObject *set_chunk_reader(PyObject *self, PyObject *args)
{
    PyObject *detach_addr, *free_addr, *reorder_addr;
    unsigned long long probe, row;
    if (!PyArg_ParseTuple(args, "OOOKK", &detach_addr, &free_addr, &reorder_addr, &probe, &row))
        return NULL;
    in_job_ready = 0;
    if (get_data == NULL || push_sync == NULL)
        Py_RETURN_FALSE;
    detach = (Detach)PyLong_AsVoidPtr(detach_addr);
    free_array = (Free)PyLong_AsVoidPtr(free_addr);
    chunk_reorder = (ChunkReorder)PyLong_AsVoidPtr(reorder_addr);
    if (PyErr_Occurred())
        return NULL;
    void *p = (void *)(uintptr_t)probe, *r = (void *)(uintptr_t)row;
    void *p_data = NULL, *r_data = NULL;
    int64_t rows, cols;
    int64_t size = float_elements(p, &rows);
    if (detach == NULL || free_array == NULL || size <= 0 || rows < 2
        || get_data(p, &p_data) || get_data(r, &r_data) || p_data == NULL)
        Py_RETURN_FALSE;
    cols = size / rows;
    void *chunk = chunk_of(p);
    /* the array and its row share one chunk, whose storage handle starts
     * with the address of the array's data */
    int ok = chunk != NULL && chunk == chunk_of(r) && *(void **)chunk == p_data
        && (char *)r_data == (char *)p_data + cols * sizeof(float);
    if (ok && chunk_reorder != NULL) {
        chunk_reorder(chunk);       /* default layout: must change nothing */
        void *again = NULL;
        ok = get_data(p, &again) == 0 && again == p_data;
    }
    in_job_ready = ok;
    return PyBool_FromLong(ok);
}

/* update_many_async(sequence of requests, as update_many's): as update_many,
 * but each job reads its arrays' addresses when it runs, and nothing waits
 * (see the top of this file).  Only after set_chunk_reader returned True. */
static PyObject *update_many_async(PyObject *self, PyObject *requests)
{
    if (!in_job_ready) {
        PyErr_SetString(PyExc_RuntimeError, "update_many_async: set_chunk_reader did not "
                        "accept this MXNet; use update_many");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(requests, "update_many_async takes a sequence of tuples");
    if (seq == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    PyObject *result = PyList_New(count);
    for (Py_ssize_t i = 0; result != NULL && i < count; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Request request;
        if (!PyTuple_Check(item)) {
            PyErr_SetString(PyExc_TypeError, "update_many_async takes a sequence of tuples");
            Py_CLEAR(result);
            break;
        }
        if (!parse_request(item, &request)) {
            Py_CLEAR(result);
            break;
        }
        int pushed;
        /* without the GIL: under the NaiveEngine the job runs right here */
        Py_BEGIN_ALLOW_THREADS
        pushed = push_update_in_job(&request);
        Py_END_ALLOW_THREADS
        if (pushed < 0) {
            PyErr_NoMemory();
            Py_CLEAR(result);
            break;
        }
        PyList_SET_ITEM(result, i, PyBool_FromLong(pushed));
    }
    Py_DECREF(seq);
    return result;
}

/* failed_jobs(): how many in-job updates could not read their arrays (and
 * left them unchanged) since the last call; the count restarts at 0. */
static PyObject *take_failed_jobs(PyObject *self, PyObject *unused)
{
    return PyLong_FromLong(__atomic_exchange_n(&failed_jobs, 0, __ATOMIC_SEQ_CST));
}

static PyMethodDef methods[] = {
    {"set_engine", set_engine, METH_VARARGS,
     "set_engine(addresses of MXEnginePushSyncND, MXNDArrayGetData, MXNDArrayWaitAll, "
     "MXNDArrayGetShapeEx[64], "
     "MXNDArrayGetDType, MXNDArrayGetStorageType, MXNDArrayGetContext; whether the shape "
     "reader is the 64-bit one)"},
    {"update_many", update_many, METH_O,
     "update_many([(weight, grad, history handles, lr, eps, rescale, clip, decay)]) -> "
     "[pushed?], after one wait"},
    {"set_chunk_reader", set_chunk_reader, METH_VARARGS,
     "set_chunk_reader(addresses of MXNDArrayDetach, MXNDArrayFree, "
     "NDArray::Chunk::Reorder2Default or 0; probe handle, handle of its second row) -> "
     "whether update_many_async may be used"},
    {"update_many_async", update_many_async, METH_O,
     "update_many_async([update_many's requests]) -> [pushed?]; the jobs read the "
     "addresses, nothing waits"},
    {"failed_jobs", take_failed_jobs, METH_NOARGS,
     "failed_jobs() -> in-job updates that could not read their arrays since the last call"},
    {NULL, NULL, 0, NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_adagrad",
    "AdaGrad's dense float32 CPU update as one engine operation (see optim.py).", -1, methods
};

PyMODINIT_FUNC PyInit__adagrad(void)
{
    return PyModule_Create(&module);
}
