/*
 * span_bytes' join, compiled: the parts of one OTLP Span message -> its bytes, in one call.
 *
 * span_bytes.encode_spans decides which fields a span has and in what order (in Python, one
 * copy of that logic); what it costs per record is writing ~30 int attributes one Python call
 * at a time. So it hands this function a list of parts:
 *   - bytes (exactly bytes): copied as they are (pre-encoded fields, cached string attributes);
 *   - an IntKey (a bytes subclass holding the KeyValue.key field and the KeyValue.value tag)
 *     followed by an int: the Span.attributes field of that int attribute.
 * span_bytes._join_py is the same function in Python (the fallback where this did not build),
 * and tests/test_span_bytes.py requires both to write the same bytes.
 *
 * An int outside [0, INT64_MAX] raises OverflowError: span_bytes then joins that span in
 * Python, which writes it as otlp_wire does (rare: counters beyond int64).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define T_SPAN_ATTR 0x4a /* Span.attributes (9), length-delimited */
#define T_ANY_INT 0x18   /* AnyValue.int_value (3), varint */

static Py_ssize_t varint_len(uint64_t v)
{
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static char *put_varint(char *p, uint64_t v)
{
    while (v >= 0x80) {
        *p++ = (char)((v & 0x7f) | 0x80);
        v >>= 7;
    }
    *p++ = (char)v;
    return p;
}

/* The int after an IntKey at parts[i]; -1 with an exception set when it is missing, not an int
 * or out of range. */
static int int_value(PyObject *parts, Py_ssize_t i, uint64_t *out)
{
    if (i + 1 >= PyList_GET_SIZE(parts)) {
        PyErr_SetString(PyExc_ValueError, "IntKey without a value");
        return -1;
    }
    PyObject *v = PyList_GET_ITEM(parts, i + 1);
    if (!PyLong_Check(v)) {
        PyErr_Format(PyExc_TypeError, "int attribute value is %.80s", Py_TYPE(v)->tp_name);
        return -1;
    }
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || x < 0) {
        PyErr_SetString(PyExc_OverflowError, "int attribute outside [0, INT64_MAX]");
        return -1;
    }
    if (x == -1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)x;
    return 0;
}

/* KeyValue: key field + value tag (the IntKey's bytes), AnyValue length, int tag, varint. */
static Py_ssize_t int_attr_len(Py_ssize_t key_len, uint64_t v)
{
    Py_ssize_t kv = key_len + 2 + varint_len(v);
    return 1 + 1 + kv; /* Span.attributes tag, KeyValue length (< 0x80: IntKey checks) */
}

static PyObject *join(PyObject *self, PyObject *parts)
{
    (void)self;
    if (!PyList_CheckExact(parts)) {
        PyErr_SetString(PyExc_TypeError, "join takes a list");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(parts), total = 0;
    uint64_t v;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(parts, i);
        if (PyBytes_CheckExact(item)) {
            total += PyBytes_GET_SIZE(item);
        } else if (PyBytes_Check(item)) {
            if (int_value(parts, i, &v) < 0)
                return NULL;
            total += int_attr_len(PyBytes_GET_SIZE(item), v);
            i++;
        } else {
            PyErr_Format(PyExc_TypeError, "span part is %.80s", Py_TYPE(item)->tp_name);
            return NULL;
        }
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyList_GET_ITEM(parts, i);
        Py_ssize_t len = PyBytes_GET_SIZE(item);
        if (PyBytes_CheckExact(item)) {
            memcpy(p, PyBytes_AS_STRING(item), (size_t)len);
            p += len;
            continue;
        }
        /* checked in the first pass; the list is ours, nothing ran in between */
        (void)int_value(parts, i, &v);
        i++;
        Py_ssize_t vlen = varint_len(v);
        *p++ = (char)T_SPAN_ATTR;
        *p++ = (char)(len + 2 + vlen);
        memcpy(p, PyBytes_AS_STRING(item), (size_t)len);
        p += len;
        *p++ = (char)(1 + vlen);
        *p++ = (char)T_ANY_INT;
        p = put_varint(p, v);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"join", join, METH_O, "The parts of one OTLP Span message -> its bytes (see span_bytes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_span_join", "span_bytes' join, compiled.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__span_join(void)
{
    return PyModule_Create(&module);
}
