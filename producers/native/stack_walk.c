/* Every thread's Python stack as its code objects, walked in C while this thread holds the GIL.
 *
 * sample(skip) -> [(thread_ident, (code, ...)), ...], innermost frame first, at most MAX_DEPTH
 * frames a thread; threads whose ident is in the set `skip` are left out.
 *
 * Why C: no other thread runs while the walk holds the GIL, and every frame object the walk makes
 * is released before it returns, so no frame of another thread outlives its function because of the
 * sampler. A walk in Python (sys._current_frames(), then f_back) can lose the GIL between two
 * bytecodes while it holds other threads' frame objects; on CPython 3.11 that has crashed sampling
 * profilers (SIGSEGV in PyFrame_GetBack), and crashed two of rankscope's sampling processes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <frameobject.h>

#define MAX_DEPTH 256
#define ABI 1

static PyObject *sample(PyObject *self, PyObject *skip) {
    (void)self;
    if (!PyAnySet_Check(skip)) {
        PyErr_SetString(PyExc_TypeError, "sample(skip): skip must be a set of thread idents");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    PyThreadState *me = PyThreadState_Get();
    PyObject *codes[MAX_DEPTH];
    for (PyThreadState *ts = PyInterpreterState_ThreadHead(PyThreadState_GetInterpreter(me)); ts != NULL;
         ts = PyThreadState_Next(ts)) {
        if (ts == me) continue;
        PyObject *ident = PyLong_FromUnsignedLong(ts->thread_id);
        if (ident == NULL) goto fail;
        int skipped = PySet_Contains(skip, ident);
        if (skipped != 0) {
            Py_DECREF(ident);
            if (skipped < 0) goto fail;
            continue;
        }
        Py_ssize_t n = 0;
        PyFrameObject *f = PyThreadState_GetFrame(ts);       /* new reference or NULL */
        while (f != NULL && n < MAX_DEPTH) {
            codes[n++] = (PyObject *)PyFrame_GetCode(f);     /* new reference */
            PyFrameObject *back = PyFrame_GetBack(f);        /* new reference or NULL */
            Py_DECREF(f);
            f = back;
        }
        Py_XDECREF(f);
        if (n == 0) {
            Py_DECREF(ident);
            continue;
        }
        PyObject *stack = PyTuple_New(n);
        if (stack == NULL) {
            for (Py_ssize_t i = 0; i < n; i++) Py_DECREF(codes[i]);
            Py_DECREF(ident);
            goto fail;
        }
        for (Py_ssize_t i = 0; i < n; i++) PyTuple_SET_ITEM(stack, i, codes[i]);   /* steals */
        PyObject *pair = PyTuple_Pack(2, ident, stack);
        Py_DECREF(ident);
        Py_DECREF(stack);
        if (pair == NULL || PyList_Append(out, pair) < 0) {
            Py_XDECREF(pair);
            goto fail;
        }
        Py_DECREF(pair);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"sample", sample, METH_O, "sample(skip: set[int]) -> list[tuple[int, tuple[code, ...]]]"},
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
