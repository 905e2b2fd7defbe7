/*
 * The BPF ring buffer's consumer, compiled: every committed record -> a list of bytes, in one
 * call, with no Python call per record.
 *
 * BCC's reader (libbpf's ring_buffer__consume) calls a ctypes callback for each record, which
 * takes the GIL, boxes three arguments and runs Python only to copy the record out. ring.py
 * maps the ring itself instead (the consumer page read-write, the producer page and the data
 * pages, mapped twice in a row by the kernel so no record wraps, read-only) and hands the two
 * mappings here.
 *
 * The protocol is the kernel's (kernel/bpf/ringbuf.c) and libbpf's (ringbuf.c), which this
 * follows step by step: read producer_pos with acquire; for each record from consumer_pos, read
 * its 8-byte header's length with acquire, stop at one still BUSY (reserved, not committed),
 * skip one DISCARDed, copy the rest; store consumer_pos with release once a record is copied,
 * so the kernel may reuse its space.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define BUSY_BIT (1U << 31)
#define DISCARD_BIT (1U << 30)
#define HDR_SZ 8

static PyObject *consume(PyObject *self, PyObject *args)
{
    (void)self;
    Py_buffer cons, prod;
    Py_ssize_t page, max_records;
    unsigned long long mask;
    if (!PyArg_ParseTuple(args, "w*y*nKn", &cons, &prod, &page, &mask, &max_records))
        return NULL;
    PyObject *out = NULL;
    if (cons.len < (Py_ssize_t)sizeof(uint64_t) || page < (Py_ssize_t)sizeof(uint64_t) ||
        prod.len < page + 2 * ((Py_ssize_t)mask + 1)) {
        PyErr_SetString(PyExc_ValueError, "ring mappings smaller than the ring");
        goto done;
    }
    out = PyList_New(0);
    if (out == NULL)
        goto done;
    uint64_t *consumer_pos = (uint64_t *)cons.buf;
    const uint64_t *producer_pos = (const uint64_t *)prod.buf;
    const char *data = (const char *)prod.buf + page;
    uint64_t cpos = __atomic_load_n(consumer_pos, __ATOMIC_ACQUIRE);
    int more = 1;
    while (more && PyList_GET_SIZE(out) < max_records) {
        more = 0;
        uint64_t ppos = __atomic_load_n(producer_pos, __ATOMIC_ACQUIRE);
        while (cpos < ppos && PyList_GET_SIZE(out) < max_records) {
            const uint32_t *hdr = (const uint32_t *)(data + (cpos & mask));
            uint32_t len = __atomic_load_n(hdr, __ATOMIC_ACQUIRE);
            if (len & BUSY_BIT)
                goto stop; /* reserved, not yet committed: the rest waits for it */
            uint32_t size = len & ~(BUSY_BIT | DISCARD_BIT);
            if ((uint64_t)size + HDR_SZ > mask + 1) {
                PyErr_SetString(PyExc_RuntimeError, "ring record longer than the ring");
                Py_CLEAR(out);
                goto done;
            }
            if (!(len & DISCARD_BIT)) {
                PyObject *rec = PyBytes_FromStringAndSize((const char *)hdr + HDR_SZ, size);
                if (rec == NULL || PyList_Append(out, rec) < 0) {
                    Py_XDECREF(rec);
                    Py_CLEAR(out);
                    goto done; /* consumer_pos is left before this record: it is read again */
                }
                Py_DECREF(rec);
            }
            cpos += ((uint64_t)size + HDR_SZ + 7) & ~(uint64_t)7;
            __atomic_store_n(consumer_pos, cpos, __ATOMIC_RELEASE);
            more = 1;
        }
    }
stop:
done:
    PyBuffer_Release(&cons);
    PyBuffer_Release(&prod);
    return out;
}

static PyMethodDef methods[] = {
    {"consume", consume, METH_VARARGS,
     "consume(consumer_page, producer_and_data, page_size, mask, max_records) -> list[bytes]: "
     "the committed records, in order (see ring.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_ring_read", "The BPF ring buffer's consumer, compiled.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ring_read(void)
{
    return PyModule_Create(&module);
}
