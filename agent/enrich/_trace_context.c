/*
 * The common case of correlate.trace_context, compiled: a record that carries exactly one
 * traceparent header whose value is the plain version-00 form (lowercase hex, the three dashes
 * in place, 55 bytes, non-zero ids) -> (trace_id, parent_id, flags), read straight from the
 * kernel's struct (bpf/http_record.h). Anything else -> None, and correlate.trace_context
 * decides it in Python (traceparent.parse, the W3C rules and every rejection reason).
 *
 * So this can only accept, never reject: it accepts exactly the values traceparent.parse reads
 * as valid version 00, with the same ids, which tests/test_traceparent.py checks over the
 * rules' edges, mutations of a valid value and arbitrary bytes (a value accepted here that
 * parse rejects, or reads otherwise, would put a span in the wrong trace).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include <linux/types.h>

#include "plain_traceparent.h"

static PyObject *trace_id_int(uint64_t hi, uint64_t lo)
{
    PyObject *h = PyLong_FromUnsignedLongLong(hi), *l = PyLong_FromUnsignedLongLong(lo);
    PyObject *k64 = PyLong_FromLong(64), *shifted = NULL, *out = NULL;
    if (h && l && k64 && (shifted = PyNumber_Lshift(h, k64)) != NULL)
        out = PyNumber_Or(shifted, l);
    Py_XDECREF(h);
    Py_XDECREF(l);
    Py_XDECREF(k64);
    Py_XDECREF(shifted);
    return out;
}

static PyObject *plain_traceparent(PyObject *self, PyObject *rec)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(rec, &view, PyBUF_SIMPLE) < 0)
        return NULL;
    if (view.len < (Py_ssize_t)sizeof(struct http_record)) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "rec is shorter than struct http_record");
        return NULL;
    }
    uint64_t hi, lo, parent, flags;
    int plain = plain_traceparent_ids(view.buf, &hi, &lo, &parent, &flags);
    PyBuffer_Release(&view);
    if (!plain)
        Py_RETURN_NONE;
    PyObject *trace_id = trace_id_int(hi, lo);
    if (trace_id == NULL)
        return NULL;
    return Py_BuildValue("(NKK)", trace_id, (unsigned long long)parent, (unsigned long long)flags);
}

static PyMethodDef methods[] = {
    {"plain_traceparent", plain_traceparent, METH_O,
     "rec -> (trace_id, parent_id, flags) for one plain valid version-00 traceparent, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_trace_context", "correlate.trace_context's common case, compiled.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__trace_context(void)
{
    return PyModule_Create(&module);
}
