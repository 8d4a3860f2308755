/* Every thread's Python stack as its code objects, walked in C while this thread holds the GIL.
 *
 * sample(skip) -> [(thread_ident, (code, ...), (id(code), ...)), ...], innermost frame first, at most
 * MAX_DEPTH frames a thread; threads whose ident is in the set `skip` are left out. The ids make a
 * stack's key without a Python loop over its frames (a code object's own hash reads its contents).
 *
 * The walk reads each thread's interpreter frames (_PyInterpreterFrame: its code and the frame
 * before it) as faulthandler does. It creates no frame object and allocates nothing through the
 * object allocator until every thread has been read, so no garbage collection, finalizer or
 * switch of the GIL can run in the middle of it: another thread cannot end, free its thread state
 * or pop a frame while the walk holds a pointer into it. Walking through frame objects instead
 * (PyThreadState_GetFrame, PyFrame_GetBack, or sys._current_frames() and f_back in Python)
 * allocates a frame object per frame; that allocation can collect garbage and run Python code
 * that gives the GIL away, and such walks crashed rankscope's sampled ranks with SIGSEGV.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX < 0x030B0000
#error "rankscope's stack walker needs Python 3.11 or newer"
#endif

#define Py_BUILD_CORE 1
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE

#define MAX_DEPTH 256
#define ABI 3

#if PY_VERSION_HEX >= 0x030D0000
#define TOP_FRAME(ts) ((ts)->current_frame)
#else
#define TOP_FRAME(ts) ((ts)->cframe != NULL ? (ts)->cframe->current_frame : NULL)
#endif

#if PY_VERSION_HEX >= 0x030D0000
#define FRAME_CODE(f) ((PyObject *)_PyFrame_GetCode(f))
#else
#define FRAME_CODE(f) ((PyObject *)(f)->f_code)
#endif

typedef struct {
    unsigned long ident;
    Py_ssize_t start;   /* index of its first code in the codes buffer */
    Py_ssize_t depth;
} thread_span;

/* A growing buffer from the raw allocator, which never collects garbage or runs Python code. */
static int grow(void **buf, Py_ssize_t *cap, Py_ssize_t need, size_t item) {
    if (need <= *cap) return 0;
    Py_ssize_t n = *cap ? *cap : 16;
    while (n < need) n *= 2;
    void *p = PyMem_RawRealloc(*buf, (size_t)n * item);
    if (p == NULL) return -1;
    *buf = p;
    *cap = n;
    return 0;
}

static PyObject *sample(PyObject *self, PyObject *skip) {
    (void)self;
    if (!PyAnySet_Check(skip)) {
        PyErr_SetString(PyExc_TypeError, "sample(skip): skip must be a set of thread idents");
        return NULL;
    }
    PyThreadState *me = PyThreadState_Get();
    thread_span *spans = NULL;
    PyObject **codes = NULL;
    Py_ssize_t nspans = 0, capspans = 0, ncodes = 0, capcodes = 0;
    PyObject *out = NULL;
    int oom = 0;

    /* The walk: no allocation from the object allocator, no reference dropped. */
    for (PyThreadState *ts = PyInterpreterState_ThreadHead(PyThreadState_GetInterpreter(me)); ts != NULL;
         ts = PyThreadState_Next(ts)) {
        if (ts == me) continue;
        if (grow((void **)&spans, &capspans, nspans + 1, sizeof(thread_span)) < 0 ||
            grow((void **)&codes, &capcodes, ncodes + MAX_DEPTH, sizeof(PyObject *)) < 0) {
            oom = 1;
            break;
        }
        thread_span *span = &spans[nspans];
        span->ident = ts->thread_id;
        span->start = ncodes;
        span->depth = 0;
        for (_PyInterpreterFrame *f = TOP_FRAME(ts); f != NULL && span->depth < MAX_DEPTH; f = f->previous) {
            if (_PyFrame_IsIncomplete(f)) continue;
            PyObject *code = FRAME_CODE(f);
            if (code == NULL || !PyCode_Check(code)) continue;
            Py_INCREF(code);
            codes[ncodes++] = code;
            span->depth++;
        }
        if (span->depth > 0) nspans++;
    }
    if (oom) {
        PyErr_NoMemory();
        goto done;
    }

    /* Building the result may collect garbage: the walk is over and every code is held. */
    out = PyList_New(0);
    if (out == NULL) goto done;
    for (Py_ssize_t s = 0; s < nspans; s++) {
        PyObject *ident = PyLong_FromUnsignedLong(spans[s].ident);
        if (ident == NULL) goto fail;
        int skipped = PySet_Contains(skip, ident);
        if (skipped != 0) {
            Py_DECREF(ident);
            if (skipped < 0) goto fail;
            continue;
        }
        PyObject *stack = PyTuple_New(spans[s].depth);
        PyObject *ids = PyTuple_New(spans[s].depth);
        if (stack == NULL || ids == NULL) {
            Py_XDECREF(stack);
            Py_XDECREF(ids);
            Py_DECREF(ident);
            goto fail;
        }
        for (Py_ssize_t i = 0; i < spans[s].depth; i++) {
            PyObject *code = codes[spans[s].start + i];
            PyObject *id = PyLong_FromVoidPtr(code);
            if (id == NULL) {
                Py_DECREF(stack);
                Py_DECREF(ids);
                Py_DECREF(ident);
                goto fail;
            }
            Py_INCREF(code);
            PyTuple_SET_ITEM(stack, i, code);   /* steals the new reference */
            PyTuple_SET_ITEM(ids, i, id);
        }
        PyObject *pair = PyTuple_Pack(3, ident, stack, ids);
        Py_DECREF(ident);
        Py_DECREF(stack);
        Py_DECREF(ids);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            goto fail;
        }
        Py_DECREF(pair);
    }
    goto done;
fail:
    Py_CLEAR(out);
done:
    for (Py_ssize_t i = 0; i < ncodes; i++) Py_DECREF(codes[i]);
    PyMem_RawFree(codes);
    PyMem_RawFree(spans);
    return out;
}

static PyMethodDef methods[] = {
    {"sample", sample, METH_O, "sample(skip: set[int]) -> list[tuple[int, tuple[code, ...], tuple[int, ...]]]"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "rankscope_stack_walk", NULL, -1, methods};

PyMODINIT_FUNC PyInit_rankscope_stack_walk(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    if (m != NULL && PyModule_AddIntConstant(m, "MAX_DEPTH", MAX_DEPTH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
