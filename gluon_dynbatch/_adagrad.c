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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PushSyncND push_sync = NULL;
static GetData get_data = NULL;
static WaitAll wait_all = NULL;
static void *get_shape = NULL;
static int shape_64 = 0;
static GetInt get_dtype = NULL, get_stype = NULL;
static GetContext get_context = NULL;

/* mxnet::Context, as the engine reads it through a ContextHandle */
static const struct { int dev_type; int32_t dev_id; } cpu_context = {1, 0};

typedef struct {
    float *weight, *history;
    const float *grad;
    int64_t rows, cols;
    float lr, eps, rescale, clip, decay;   /* clip < 0: none; decay 1: no weight decay */
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

static void run_job(void *run_context, void *param)
{
    const Job *job = (const Job *)param;
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

/* Push one update, without the GIL, once no op is pending: 1 if pushed, 0
 * if the arrays are not three dense float32 CPU arrays of one shape (or
 * MXNet refused), -1 out of memory. */
static int push_update(const Request *r)
{
    int64_t rows, g_rows, h_rows;
    int64_t size = float_elements(r->weight, &rows);
    if (size <= 0 || rows <= 0 || float_elements(r->grad, &g_rows) != size || g_rows != rows
        || float_elements(r->history, &h_rows) != size || h_rows != rows)
        return 0;
    void *w_data = NULL, *g_data = NULL, *h_data = NULL;
    if (get_data(r->weight, &w_data) || get_data(r->grad, &g_data)
        || get_data(r->history, &h_data) || !w_data || !g_data || !h_data)
        return 0;
    Job *job = malloc(sizeof(Job));
    if (job == NULL)
        return -1;
    *job = (Job){w_data, h_data, g_data, rows, size / rows, (float)r->lr, (float)r->eps,
                 (float)r->rescale, (float)r->clip, (float)r->decay};
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
 * ops may need it (Python custom ops), and MXNDArrayGetData may wait. */
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
    return out_of_memory ? -1 : 0;
}

/* update(weight, grad, history handles as ints, lr, eps, rescale, clip,
 * decay): True once pushed; False when the arrays are not three dense
 * float32 arrays of one shape (the caller then takes MXNet's path). */
static PyObject *update(PyObject *self, PyObject *args)
{
    Request request;
    int pushed;
    if (!parse_request(args, &request))
        return NULL;
    if (push_sync == NULL)
        Py_RETURN_FALSE;
    if (push_all(&request, &pushed, 1) < 0)
        return PyErr_NoMemory();
    return PyBool_FromLong(pushed);
}

/* update_many(sequence of update's argument tuples): a list of whether
 * each was pushed.  One wait serves them all: a Trainer step's updates,
 * each waiting on its own, waited for the one pushed before it. */
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
    if (push_sync != NULL && count && push_all(parsed, pushed, count) < 0) {
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

static PyMethodDef methods[] = {
    {"set_engine", set_engine, METH_VARARGS,
     "set_engine(addresses of MXEnginePushSyncND, MXNDArrayGetData, MXNDArrayWaitAll, "
     "MXNDArrayGetShapeEx[64], "
     "MXNDArrayGetDType, MXNDArrayGetStorageType, MXNDArrayGetContext; whether the shape "
     "reader is the 64-bit one)"},
    {"update", update, METH_VARARGS,
     "update(weight, grad, history handles, lr, eps, rescale, clip, decay) -> pushed?"},
    {"update_many", update_many, METH_O,
     "update_many([update's argument tuples]) -> [pushed?], after one wait"},
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
