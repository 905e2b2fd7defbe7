/*
 * otlp_proto.py and queue.py's per-span loops, compiled: what the exporter thread does with each
 * span the span builder already wrote (model.EncodedSpan, a named tuple (resource, body)).
 *
 * request(spans, encoded, resource_field, heads, encode_span) -> bytes, or None
 *   The serialized ExportTraceServiceRequest that otlp_proto.encode_request_bytes_py writes:
 *   one ResourceSpans per distinct resource_field(resource), in order of first appearance, each
 *   with one ScopeSpans (the scope field pre-encoded in heads) holding its spans' bodies framed
 *   as ScopeSpans.spans fields. resource_field is called once per distinct resource object,
 *   encode_span for each span that is not an `encoded` (a model.Span: a child span the stages
 *   made, a few in a batch). None when the batch has more distinct resources than MAX_GROUPS:
 *   the caller takes the Python path, the reference (tests/test_exporters.py requires both to
 *   write the same bytes).
 *
 * take(q, most, limit, encoded, guess) -> list
 *   queue.BatchExportQueue._take: up to `most` spans off the deque's left, stopping before the
 *   span that would take the batch past `limit` bytes (an `encoded` counts its body's length,
 *   anything else `guess`); at least one span.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "varint.h"

#define MAX_GROUPS 64 /* distinct resources a request (one per served process) */

struct group {
    PyObject *field;       /* ResourceSpans.resource field (a new reference) */
    Py_ssize_t spans_len;  /* the framed spans' bytes */
    Py_ssize_t scope_len;  /* ScopeSpans' length: scope field + spans */
    Py_ssize_t rs_len;     /* ResourceSpans' length */
};

/* The body of an EncodedSpan, NULL when `span` is not one (or its body is not bytes). */
static PyObject *body_of(PyObject *span, PyTypeObject *encoded)
{
    if (Py_TYPE(span) != encoded || PyTuple_GET_SIZE(span) != 2)
        return NULL;
    PyObject *body = PyTuple_GET_ITEM(span, 1);
    return PyBytes_CheckExact(body) ? body : NULL;
}

static PyObject *request(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5 || !PyList_CheckExact(args[0]) || !PyType_Check(args[1]) ||
        !PyType_IsSubtype((PyTypeObject *)args[1], &PyTuple_Type) ||
        !PyTuple_CheckExact(args[3]) || PyTuple_GET_SIZE(args[3]) != 4) {
        PyErr_SetString(PyExc_TypeError, "request(spans: list, encoded: type, resource_field, "
                                         "heads: 4-tuple, encode_span)");
        return NULL;
    }
    PyObject *spans = args[0], *resource_field = args[2], *heads = args[3];
    PyObject *encode_span = args[4];
    PyTypeObject *encoded = (PyTypeObject *)args[1];
    /* heads: the three field tags (one byte each) and the scope field */
    char tag[3];
    for (int i = 0; i < 3; i++) {
        PyObject *t = PyTuple_GET_ITEM(heads, i);
        if (!PyBytes_CheckExact(t) || PyBytes_GET_SIZE(t) != 1) {
            PyErr_SetString(PyExc_TypeError, "a field tag is one byte");
            return NULL;
        }
        tag[i] = PyBytes_AS_STRING(t)[0];
    }
    PyObject *scope = PyTuple_GET_ITEM(heads, 3);
    if (!PyBytes_CheckExact(scope)) {
        PyErr_SetString(PyExc_TypeError, "the scope field is bytes");
        return NULL;
    }
    const char t_req_rs = tag[0], t_rs_scope = tag[1], t_ss_span = tag[2];

    Py_ssize_t n = PyList_GET_SIZE(spans), ngroups = 0, nres = 0;
    struct group g[MAX_GROUPS];
    PyObject *res_obj[MAX_GROUPS]; /* borrowed: the spans (or `keep`) hold them */
    int res_group[MAX_GROUPS];
    unsigned char *gid = PyMem_Malloc(n ? (size_t)n : 1);
    PyObject **bodies = PyMem_Malloc((n ? (size_t)n : 1) * sizeof(PyObject *));
    /* what this call made for a model.Span: its body and resource, alive until we return */
    PyObject *keep = PyList_New(0);
    PyObject *out = NULL;
    if (gid == NULL || bodies == NULL || keep == NULL) {
        PyErr_NoMemory();
        goto done;
    }

    int last = -1; /* the previous span's resource slot: batches are mostly one process */
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *span = PyList_GET_ITEM(spans, i);
        PyObject *body = body_of(span, encoded), *res;
        if (body != NULL) {
            res = PyTuple_GET_ITEM(span, 0);
        } else { /* a model.Span (a child span the stages made): encoded in Python */
            body = PyObject_CallOneArg(encode_span, span);
            if (body == NULL)
                goto done;
            int err = PyList_Append(keep, body);
            Py_DECREF(body);
            if (err < 0)
                goto done;
            if (!PyBytes_CheckExact(body)) {
                PyErr_SetString(PyExc_TypeError, "encode_span returns bytes");
                goto done;
            }
            res = PyObject_GetAttrString(span, "resource");
            if (res == NULL)
                goto done;
            err = PyList_Append(keep, res);
            Py_DECREF(res);
            if (err < 0)
                goto done;
        }
        bodies[i] = body;
        int r = last;
        if (r < 0 || res_obj[r] != res) {
            for (r = 0; r < nres && res_obj[r] != res; r++)
                ;
            if (r == nres) { /* a resource object not seen in this batch */
                if (nres == MAX_GROUPS)
                    goto fallback;
                PyObject *field = PyObject_CallOneArg(resource_field, res);
                if (field == NULL)
                    goto done;
                if (!PyBytes_CheckExact(field)) {
                    Py_DECREF(field);
                    PyErr_SetString(PyExc_TypeError, "resource_field returns bytes");
                    goto done;
                }
                int k; /* an equal Resource from another object shares its group */
                for (k = 0; k < ngroups; k++) {
                    if (PyBytes_GET_SIZE(g[k].field) == PyBytes_GET_SIZE(field) &&
                        !memcmp(PyBytes_AS_STRING(g[k].field), PyBytes_AS_STRING(field),
                                (size_t)PyBytes_GET_SIZE(field)))
                        break;
                }
                if (k == ngroups) {
                    g[k].field = field;
                    g[k].spans_len = 0;
                    ngroups++;
                } else {
                    Py_DECREF(field);
                }
                res_obj[nres] = res;
                res_group[nres++] = k;
            }
            last = r;
        }
        Py_ssize_t len = PyBytes_GET_SIZE(body);
        gid[i] = (unsigned char)res_group[r];
        g[res_group[r]].spans_len += 1 + varint_len((uint64_t)len) + len;
    }

    Py_ssize_t total = 0, scope_len = PyBytes_GET_SIZE(scope);
    for (int k = 0; k < ngroups; k++) {
        g[k].scope_len = scope_len + g[k].spans_len;
        g[k].rs_len = PyBytes_GET_SIZE(g[k].field) + 1 + varint_len((uint64_t)g[k].scope_len) +
                      g[k].scope_len;
        total += 1 + varint_len((uint64_t)g[k].rs_len) + g[k].rs_len;
    }
    out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL)
        goto done;
    char *p = PyBytes_AS_STRING(out);
    for (int k = 0; k < ngroups; k++) {
        Py_ssize_t flen = PyBytes_GET_SIZE(g[k].field);
        *p++ = t_req_rs;
        p = put_varint(p, (uint64_t)g[k].rs_len);
        memcpy(p, PyBytes_AS_STRING(g[k].field), (size_t)flen);
        p += flen;
        *p++ = t_rs_scope;
        p = put_varint(p, (uint64_t)g[k].scope_len);
        memcpy(p, PyBytes_AS_STRING(scope), (size_t)scope_len);
        p += scope_len;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (gid[i] != k)
                continue;
            Py_ssize_t len = PyBytes_GET_SIZE(bodies[i]);
            *p++ = t_ss_span;
            p = put_varint(p, (uint64_t)len);
            memcpy(p, PyBytes_AS_STRING(bodies[i]), (size_t)len);
            p += len;
        }
    }
    goto done;
fallback:
    out = Py_NewRef(Py_None);
done:
    for (int k = 0; k < ngroups; k++)
        Py_DECREF(g[k].field);
    Py_XDECREF(keep);
    PyMem_Free(bodies);
    PyMem_Free(gid);
    return out;
}

static PyObject *popleft, *appendleft; /* the deque's method names, interned */

static PyObject *take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5 || !PyType_Check(args[3]) ||
        !PyType_IsSubtype((PyTypeObject *)args[3], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError,
                        "take(q: deque, most: int, limit: int, encoded: tuple type, guess: int)");
        return NULL;
    }
    PyObject *q = args[0];
    PyTypeObject *encoded = (PyTypeObject *)args[3];
    Py_ssize_t most = PyLong_AsSsize_t(args[1]);
    Py_ssize_t limit = PyLong_AsSsize_t(args[2]);
    Py_ssize_t guess = PyLong_AsSsize_t(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_ssize_t have = PySequence_Size(q);
    if (have < 0)
        return NULL;
    if (most > have)
        most = have;
    PyObject *batch = PyList_New(0);
    if (batch == NULL)
        return NULL;
    Py_ssize_t size = 0;
    while (PyList_GET_SIZE(batch) < most) {
        PyObject *span = PyObject_CallMethodNoArgs(q, popleft);
        if (span == NULL)
            goto fail;
        PyObject *body = body_of(span, encoded);
        size += body != NULL ? PyBytes_GET_SIZE(body) : guess;
        if (size > limit && PyList_GET_SIZE(batch) > 0) {
            /* the one span too many goes back where it was */
            PyObject *r = PyObject_CallMethodOneArg(q, appendleft, span);
            Py_DECREF(span);
            if (r == NULL)
                goto fail;
            Py_DECREF(r);
            break;
        }
        int err = PyList_Append(batch, span);
        Py_DECREF(span);
        if (err < 0)
            goto fail;
    }
    return batch;
fail:
    Py_DECREF(batch);
    return NULL;
}

static PyMethodDef methods[] = {
    {"request", (PyCFunction)(void (*)(void))request, METH_FASTCALL,
     "EncodedSpans -> an ExportTraceServiceRequest's bytes; None: take the Python path."},
    {"take", (PyCFunction)(void (*)(void))take, METH_FASTCALL,
     "The next export batch off a deque's left, within a span count and a byte limit."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_request_bytes", "otlp_proto.py and queue.py's loops, compiled.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__request_bytes(void)
{
    popleft = PyUnicode_InternFromString("popleft");
    appendleft = PyUnicode_InternFromString("appendleft");
    if (popleft == NULL || appendleft == NULL)
        return NULL;
    return PyModule_Create(&module);
}
