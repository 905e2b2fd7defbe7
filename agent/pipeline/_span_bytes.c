/*
 * span_bytes.py, compiled: an OTLP Span message's bytes in one call. Two functions:
 *
 * join(parts): the parts of one Span message -> its bytes. span_bytes._encode_py decides which
 *   fields a span has (in Python, for the records server_span leaves to it) and hands
 *   this a list of parts:
 *   - bytes (exactly bytes): copied as they are (pre-encoded fields, cached string attributes);
 *   - an IntKey (a bytes subclass holding the KeyValue.key field and the KeyValue.value tag)
 *     followed by an int: the Span.attributes field of that int attribute.
 *   span_bytes._join_py is the same function in Python. An int outside [0, INT64_MAX] raises
 *   OverflowError: span_bytes then joins that span in Python, which writes it as otlp_wire does.
 *
 * server_span(...): a record -> its server span's bytes (HTTP/1.x and HTTP/2), reading its fields
 *   straight from the kernel's struct (bpf/http_record.h, the same header the probes use) with
 *   no Python object per field. The strings (span name, method, path, a gRPC call's service and
 *   method, addresses, the process's sources, GPU samples) stay Python's, encoded and cached by
 *   span_bytes and passed in as bytes; this writes the ids, times, every int and flag attribute,
 *   HTTP/2's fixed strings and the status around them, in build_spans' order.
 *   span_bytes._encode_py is the reference: tests/test_span_bytes.py requires both, and
 *   build_spans, to write the same bytes over a varied set of records.
 *   Returns None where that path must be taken instead (a value beyond int64, CUDA sums).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include <linux/types.h>

#include "http_record.h"
#include "plain_traceparent.h"
#include "varint.h"

#define T_SPAN_ATTR 0x4a /* Span.attributes (9), length-delimited */
#define T_ANY_INT 0x18   /* AnyValue.int_value (3), varint */

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

/* ---- server_span ---------------------------------------------------------------------- */

/* span_bytes' signal bits (_SIGNAL_BITS): which probes are loaded. */
#define SIGM_RECVQ 0x01
#define SIGM_TCP_STATS 0x02
#define SIGM_SCHED 0x04
#define SIGM_FAULTS 0x08
#define SIGM_WORKSET 0x10
#define SIGM_CUDA 0x20

#define STATUS_ERROR 2
#define NO_RESPONSE_MSG "connection closed before a response"
#define PREFIX_CACHE_MAX 4096 /* request prefixes kept (cleared when full, as span_bytes' caches) */
/* What this writes besides the bytes passed in: the head (62), the status (< 64) and at most
 * ~45 int or flag attributes of at most 1 + 1 + 3 + 52 (key) + 2 + 10 bytes each. */
#define OWN_BYTES_MAX 4096

static char *put_u64_be(char *p, uint64_t v)
{
    for (int i = 7; i >= 0; i--)
        *p++ = (char)(v >> (8 * i));
    return p;
}

static char *put_u64_le(char *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        *p++ = (char)(v >> (8 * i));
    return p;
}

static char *put_bytes(char *p, PyObject *b)
{
    Py_ssize_t n = PyBytes_GET_SIZE(b);
    memcpy(p, PyBytes_AS_STRING(b), (size_t)n);
    return p + n;
}

/* A Span.attributes field up to its AnyValue: the tag, the KeyValue's length, its key field and
 * the value's tag and length, for an AnyValue of any_len bytes (key and value short: one-byte
 * lengths, as the keys and fixed values here are). */
static char *put_kv_head(char *p, const char *key, size_t klen, size_t any_len)
{
    *p++ = (char)T_SPAN_ATTR;
    *p++ = (char)(klen + 4 + any_len); /* KeyValue: 0a klen key, 12 any_len, AnyValue */
    *p++ = 0x0a;
    *p++ = (char)klen;
    memcpy(p, key, klen);
    p += klen;
    *p++ = 0x12;
    *p++ = (char)any_len;
    return p;
}

/* Span.attributes field of an int attribute. A value beyond int64 sets *beyond: the caller
 * takes the Python path, which writes it as otlp_wire does. */
static char *put_int_attr(char *p, const char *key, size_t klen, uint64_t v, int *beyond)
{
    if (v > (uint64_t)INT64_MAX) {
        *beyond = 1;
        return p;
    }
    size_t vlen = (size_t)varint_len(v);
    p = put_kv_head(p, key, klen, 1 + vlen);
    *p++ = (char)T_ANY_INT;
    return put_varint(p, v);
}

/* Span.attributes field of a bool attribute that is true. */
static char *put_true_attr(char *p, const char *key, size_t klen)
{
    p = put_kv_head(p, key, klen, 2);
    *p++ = 0x10; /* AnyValue.bool_value */
    *p++ = 0x01;
    return p;
}

/* Span.attributes field of a string attribute. */
static char *put_str_attr(char *p, const char *key, size_t klen, const char *v, size_t vlen)
{
    p = put_kv_head(p, key, klen, 2 + vlen);
    *p++ = 0x0a; /* AnyValue.string_value */
    *p++ = (char)vlen;
    memcpy(p, v, vlen);
    return p + vlen;
}

/* Span.status: an error with this message ("" for none). */
static char *put_error_status(char *p, const char *msg, size_t n)
{
    *p++ = 0x7a;
    *p++ = (char)((n ? 2 + n : 0) + 2);
    if (n) {
        *p++ = 0x12; /* Status.message */
        *p++ = (char)n;
        memcpy(p, msg, n);
        p += n;
    }
    *p++ = 0x18; /* Status.code */
    *p++ = STATUS_ERROR;
    return p;
}

/* spans._h2_ended_by: how a stream ended when not by the server's END_STREAM; NULL if so. */
static const char *h2_ended_by(unsigned flags)
{
    if (flags & H2F_RST)
        return "rst_stream";
    if (flags & H2F_GOAWAY)
        return "goaway";
    if (flags & H2F_LOST)
        return "framing_lost";
    if (flags & H2F_CLOSED)
        return "connection_close";
    return NULL;
}

/* spans.GRPC_SERVER_ERRORS with their GRPC_CODE_NAMES; NULL: not a server error. */
static const char *grpc_server_error(unsigned code)
{
    switch (code) {
    case 2:
        return "UNKNOWN";
    case 4:
        return "DEADLINE_EXCEEDED";
    case 12:
        return "UNIMPLEMENTED";
    case 13:
        return "INTERNAL";
    case 14:
        return "UNAVAILABLE";
    case 15:
        return "DATA_LOSS";
    default:
        return NULL;
    }
}

#define INT_ATTR(name, v) (p = put_int_attr(p, name, sizeof(name) - 1, (uint64_t)(v), &beyond))
#define TRUE_ATTR(name) (p = put_true_attr(p, name, sizeof(name) - 1))
#define STR_ATTR(name, v, vlen) (p = put_str_attr(p, name, sizeof(name) - 1, (v), (vlen)))
#define SHARED "tracejoin.work.shared."

/* An int argument as uint64 (mask: ids); -1 with an exception set when it is not an int. */
static int arg_u64(PyObject *o, uint64_t *out)
{
    if (!PyLong_Check(o)) {
        PyErr_Format(PyExc_TypeError, "expected an int, got %.80s", Py_TYPE(o)->tp_name);
        return -1;
    }
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(o);
    return (*out == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int arg_bytes(PyObject *o, const char *what)
{
    if (PyBytes_CheckExact(o))
        return 0;
    PyErr_Format(PyExc_TypeError, "%s must be bytes, not %.80s", what, Py_TYPE(o)->tp_name);
    return -1;
}

/* The request's (pre, method_original, rpc) fields from `prefixes`, keyed by the method and path
 * bytes and whether an HTTP/2 stream carried a grpc-status (its name is then the gRPC call's);
 * on a miss make_prefix(method, path, grpc) makes them (span_bytes._request_prefix). New refs. */
static int request_prefix(const struct http_record *r, int grpc, PyObject *prefixes,
                          PyObject *make, PyObject *fields[3])
{
    size_t mlen = r->method_len < HTTP_METHOD_MAX ? r->method_len : HTTP_METHOD_MAX;
    size_t plen = r->path_len < HTTP_PATH_MAX ? r->path_len : HTTP_PATH_MAX;
    char kb[2 + HTTP_METHOD_MAX + HTTP_PATH_MAX];
    kb[0] = (char)mlen; /* the method's length first: no two (method, path) share a key */
    kb[1] = (char)grpc;
    memcpy(kb + 2, r->method, mlen);
    memcpy(kb + 2 + mlen, r->path, plen);
    PyObject *key = PyBytes_FromStringAndSize(kb, (Py_ssize_t)(2 + mlen + plen));
    if (key == NULL)
        return -1;
    PyObject *got = PyDict_GetItemWithError(prefixes, key); /* borrowed */
    if (got == NULL) {
        if (PyErr_Occurred())
            goto fail;
        got = PyObject_CallFunction(make, "y#y#O", r->method, (Py_ssize_t)mlen, r->path,
                                    (Py_ssize_t)plen, grpc ? Py_True : Py_False);
        if (got == NULL)
            goto fail;
        if (PyDict_GET_SIZE(prefixes) >= PREFIX_CACHE_MAX)
            PyDict_Clear(prefixes);
        int bad = PyDict_SetItem(prefixes, key, got);
        Py_DECREF(got); /* the dict holds it */
        if (bad < 0)
            goto fail;
    }
    Py_DECREF(key);
    if (!PyTuple_CheckExact(got) || PyTuple_GET_SIZE(got) != 3) {
        PyErr_SetString(PyExc_TypeError, "make_prefix must return (bytes, bytes, bytes)");
        return -1;
    }
    for (int i = 0; i < 3; i++)
        if (arg_bytes(PyTuple_GET_ITEM(got, i), "a request prefix field") < 0)
            return -1;
    for (int i = 0; i < 3; i++)
        fields[i] = Py_NewRef(PyTuple_GET_ITEM(got, i));
    return 0;
fail:
    Py_DECREF(key);
    return -1;
}

/* One end of the connection: writer(address) (a Span.attributes field, bytes) and the port.
 * 1 when the port cannot be an int attribute here (the Python path writes it). */
static int endpoint(PyObject *ep, const char *addr_name, const char *port_name, PyObject *writer,
                    PyObject **field, uint64_t *port)
{
    PyObject *addr = PyObject_GetAttrString(ep, addr_name);
    if (addr == NULL)
        return -1;
    *field = PyObject_CallOneArg(writer, addr);
    Py_DECREF(addr);
    if (*field == NULL)
        return -1;
    if (arg_bytes(*field, "an address field") < 0)
        return -1;
    PyObject *po = PyObject_GetAttrString(ep, port_name);
    if (po == NULL)
        return -1;
    int overflow = 0;
    long long v = PyLong_Check(po) ? PyLong_AsLongLongAndOverflow(po, &overflow) : -1;
    Py_DECREF(po);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < 0)
        return 1;
    *port = (uint64_t)v;
    return 0;
}

/* spans.needs_children: whether child_spans can return anything for this record. */
static int needs_children(const struct http_record *r, unsigned signals, int queued, int tracked,
                          uint64_t recvq_threshold, uint64_t runq_threshold)
{
    if (queued && (signals & SIGM_RECVQ) && r->read_ns - r->arrival_ns >= recvq_threshold)
        return 1;
    if (signals & SIGM_SCHED)
        for (int i = 0; i < RUNQ_SLOTS; i++)
            if (r->runq[i].dur_ns >= runq_threshold)
                return 1;
    return tracked && (r->ws_nslots > 0 || (r->ws_flags & WSF_CUDA));
}

static PyObject *k64; /* the int 64, for the trace id's high half */

/* What write_span needs besides the record and its request prefix. */
struct span_in {
    uint64_t trace_hi, trace_lo, span_id, parent_id, trace_flags;
    uint64_t offset; /* kernel monotonic ns + this = Unix epoch ns (two's complement) */
    PyObject *extra, *gpu;   /* bytes */
    PyObject *saddr, *caddr; /* bytes, or NULL: no endpoints */
    uint64_t lport, rport;
    unsigned signals;
    int tlb_fallback;
};

/* plan: (signal bits, TLB flush fallback, recvq child threshold ns, runq child threshold ns) */
static int plan_arg(PyObject *plan, struct span_in *in, uint64_t *recvq_threshold,
                    uint64_t *runq_threshold)
{
    uint64_t signals, tlb_fallback;
    if (!PyTuple_CheckExact(plan) || PyTuple_GET_SIZE(plan) != 4) {
        PyErr_SetString(PyExc_TypeError, "plan must be a 4-tuple");
        return -1;
    }
    if (arg_u64(PyTuple_GET_ITEM(plan, 0), &signals) < 0
        || arg_u64(PyTuple_GET_ITEM(plan, 1), &tlb_fallback) < 0
        || arg_u64(PyTuple_GET_ITEM(plan, 2), recvq_threshold) < 0
        || arg_u64(PyTuple_GET_ITEM(plan, 3), runq_threshold) < 0)
        return -1;
    in->signals = (unsigned)signals;
    in->tlb_fallback = tlb_fallback != 0;
    return 0;
}

/* A span is written in a buffer (on the stack when it fits), then copied into a body of its
 * exact size: a body allocated at its upper bound and cut down after would leave the heap a gap
 * per span. NULL with an exception set. */
#define STACK_SPAN 8192
static char *span_buf(char *stack, size_t need)
{
    char *buf = need <= STACK_SPAN ? stack : PyMem_Malloc(need);
    if (buf == NULL)
        PyErr_NoMemory();
    return buf;
}

/* The body from buf..end (Py_None when a value was beyond int64); frees a heap buffer. */
static PyObject *span_body(char *stack, char *buf, const char *end, int beyond)
{
    PyObject *out = beyond ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize(buf, end - buf);
    if (buf != stack)
        PyMem_Free(buf);
    return out;
}

/* A Span message's ids, times and flags (otlp_wire.span_head). */
static char *put_head(char *p, const struct span_in *in, uint64_t span_id, uint64_t parent_id,
                      uint64_t start, uint64_t end)
{
    *p++ = 0x0a;
    *p++ = 0x10;
    p = put_u64_be(p, in->trace_hi);
    p = put_u64_be(p, in->trace_lo);
    *p++ = 0x12;
    *p++ = 0x08;
    p = put_u64_be(p, span_id);
    if (parent_id) {
        *p++ = 0x22;
        *p++ = 0x08;
        p = put_u64_be(p, parent_id);
    }
    *p++ = 0x39;
    p = put_u64_le(p, start);
    *p++ = 0x41;
    p = put_u64_le(p, end);
    *p++ = (char)0x85;
    *p++ = 0x01;
    *p++ = (char)(in->trace_flags & 0xff);
    *p++ = 0;
    *p++ = 0;
    *p++ = 0;
    return p;
}

/* The record's server span body (new bytes); Py_None (new ref) when a value is beyond int64 (the
 * Python path writes it); NULL with an exception set. */
static PyObject *write_span(const struct http_record *r, PyObject *const prefix[3],
                            const struct span_in *in)
{
    PyObject *pre = prefix[0], *mo = prefix[1], *rpc = prefix[2];
    unsigned on = in->signals;
    int tracked = (on & SIGM_WORKSET) && (r->ws_flags & WSF_TRACKED);
    int h2 = !!(r->h2_flags & H2F_STREAM);
    int grpc = h2 && r->grpc_status; /* spans.grpc_status_code: grpc-status + 1, 0: none */
    unsigned grpc_code = grpc ? (unsigned)r->grpc_status - 1 : 0;
    Py_ssize_t given = PyBytes_GET_SIZE(pre) + PyBytes_GET_SIZE(mo) + PyBytes_GET_SIZE(rpc)
                       + PyBytes_GET_SIZE(in->extra) + PyBytes_GET_SIZE(in->gpu)
                       + (in->saddr ? PyBytes_GET_SIZE(in->saddr) : 0)
                       + (in->caddr ? PyBytes_GET_SIZE(in->caddr) : 0);
    char stack[STACK_SPAN];
    char *buf = span_buf(stack, (size_t)given + OWN_BYTES_MAX);
    if (buf == NULL)
        return NULL;
    char *p = buf;
    int beyond = 0;

    uint64_t arrival = r->arrival_ns, read = r->read_ns;
    int queued = 0 < arrival && arrival <= read;
    uint64_t start = (queued ? arrival : read) + in->offset;
    uint64_t end = (r->end_ns > read ? r->end_ns : read) + in->offset;
    p = put_head(p, in, in->span_id, in->parent_id, start, end);

    /* build_spans' attributes, in its order */
    p = put_bytes(p, pre); /* name, kind, method, url.path, network.* */
    INT_ATTR("thread.id", r->tid);
    INT_ATTR("http.request.size", r->req_bytes);
    INT_ATTR("http.response.size", r->resp_bytes);
    INT_ATTR("tracejoin.connection.id", r->conn_id);
    INT_ATTR("tracejoin.connection.request_seq", r->seq);
    p = put_bytes(p, mo);
    if (r->status)
        INT_ATTR("http.response.status_code", r->status);
    const char *ended = h2_ended_by(r->h2_flags);
    if (h2) { /* build_spans' HTTP/2 block, in its order */
        STR_ATTR("network.protocol.version", "2", 1);
        INT_ATTR("tracejoin.http2.stream_id", r->seq);
        if (ended != NULL)
            STR_ATTR("tracejoin.http2.ended_by", ended, strlen(ended));
        if (r->h2_flags & H2F_UNRESOLVED)
            TRUE_ATTR("tracejoin.http2.field_unresolved");
        if (grpc) {
            STR_ATTR("rpc.system", "grpc", 4);
            INT_ATTR("rpc.grpc.status_code", grpc_code);
        }
        p = put_bytes(p, rpc); /* rpc.service, rpc.method: b"" unless a gRPC call */
    }
    if (in->saddr != NULL) {
        p = put_bytes(p, in->saddr);
        INT_ATTR("server.port", in->lport);
        p = put_bytes(p, in->caddr);
        INT_ATTR("client.port", in->rport);
    }
    p = put_bytes(p, in->extra);
    if (r->flags & REQF_PATH_TRUNC)
        TRUE_ATTR("tracejoin.http.path_truncated");
    if (queued && (on & SIGM_RECVQ))
        INT_ATTR("tracejoin.tcp.receive_queue_wait_ns", read - arrival);
    if ((r->flags & REQF_FIRST_ON_CONN) && 0 < r->est_ns && r->est_ns <= read)
        INT_ATTR("tracejoin.tcp.handshake_to_first_read_ns", read - r->est_ns);
    if (r->resp_start_ns)
        INT_ATTR("tracejoin.http.time_to_first_response_byte_ns",
                 r->resp_start_ns > read ? r->resp_start_ns - read : 0);
    if (on & SIGM_TCP_STATS) {
        INT_ATTR("tracejoin.tcp.retransmits", r->retrans);
        if (r->srtt_us)
            INT_ATTR("tracejoin.tcp.srtt_us", r->srtt_us);
        if (r->unacked_max)
            INT_ATTR("tracejoin.tcp.unacked_max_bytes", r->unacked_max);
    }
    int measured = (on & SIGM_WORKSET) ? tracked : !!(r->ws_flags & WSF_STATS);
    if (measured && (on & SIGM_SCHED)) {
        INT_ATTR("tracejoin.sched.runq_wait_ns", r->runq_ns);
        INT_ATTR("tracejoin.sched.runq_wait_max_ns", r->runq_max_ns);
        INT_ATTR("tracejoin.sched.offcpu_ns", r->offcpu_ns);
        INT_ATTR("tracejoin.sched.context_switches", r->nr_switches);
    }
    if (measured && (on & SIGM_FAULTS)) {
        INT_ATTR("tracejoin.mm.minor_faults", r->minflt);
        INT_ATTR("tracejoin.mm.major_faults", r->majflt);
    }
    /* spans._tlb_names: what the two TLB values are, when measured */
    int tlb_hw = !!(r->flags & REQF_TLB_HW), tlb = tlb_hw || in->tlb_fallback;
    if (measured && tlb_hw) {
        INT_ATTR("tracejoin.tlb.dtlb_load_misses", r->tlb_a);
        INT_ATTR("tracejoin.tlb.itlb_load_misses", r->tlb_b);
    } else if (measured && tlb) {
        INT_ATTR("tracejoin.tlb.flushes", r->tlb_a);
        INT_ATTR("tracejoin.tlb.full_flushes", r->tlb_b);
    }
    if (tracked) { /* spans._work_attributes */
        INT_ATTR("tracejoin.work.threads", r->ws_threads);
        INT_ATTR("tracejoin.work.processes", r->ws_processes);
        INT_ATTR("tracejoin.work.on_cpu_ns", r->oncpu_ns);
        INT_ATTR("tracejoin.work.reader_on_cpu_ns",
                 r->oncpu_ns > r->helper_oncpu_ns ? r->oncpu_ns - r->helper_oncpu_ns : 0);
        INT_ATTR("tracejoin.work.shared_with_max", r->ws_shared_with_max);
        if (!(r->ws_flags & WSF_NO_GAP))
            INT_ATTR("tracejoin.work.unexplained_wait_ns", r->unexplained_wait_ns);
        if (r->ws_flags & WSF_CAP)
            INT_ATTR("tracejoin.work.threads_refused", r->ws_refused);
        if (r->ws_unslotted)
            INT_ATTR("tracejoin.work.helpers_without_span", r->ws_unslotted);
        int shared = r->ws_shared_with_max != 0;
        for (int i = 0; i < WSIG_COUNT; i++)
            shared |= r->shared[i] != 0;
        if (shared) { /* spans._shared_work_attributes */
            const __u64 *sh = r->shared;
            INT_ATTR(SHARED "on_cpu_ns", sh[WSIG_ONCPU]);
            INT_ATTR(SHARED "on_cpu_apportioned_ns", r->shared_apportioned_ns);
            if (on & SIGM_SCHED) {
                INT_ATTR(SHARED "sched.runq_wait_ns", sh[WSIG_RUNQ]);
                INT_ATTR(SHARED "sched.offcpu_ns", sh[WSIG_OFFCPU]);
                INT_ATTR(SHARED "sched.context_switches", sh[WSIG_SWITCHES]);
            }
            if (on & SIGM_FAULTS) {
                INT_ATTR(SHARED "mm.minor_faults", sh[WSIG_MINFLT]);
                INT_ATTR(SHARED "mm.major_faults", sh[WSIG_MAJFLT]);
            }
            if (tlb_hw) {
                INT_ATTR(SHARED "tlb.dtlb_load_misses", sh[WSIG_TLB_A]);
                INT_ATTR(SHARED "tlb.itlb_load_misses", sh[WSIG_TLB_B]);
            } else if (tlb) {
                INT_ATTR(SHARED "tlb.flushes", sh[WSIG_TLB_A]);
                INT_ATTR(SHARED "tlb.full_flushes", sh[WSIG_TLB_B]);
            }
        }
    }
    if (r->flags & REQF_RESP_UNTERM)
        TRUE_ATTR("tracejoin.http.response_unframed");
    p = put_bytes(p, in->gpu);
    /* spans.server_status: no response, a 5xx, a gRPC code a server reports as its own error, or
     * (without a grpc-status) a stream reset or refused */
    const char *grpc_error = grpc ? grpc_server_error(grpc_code) : NULL;
    if (r->flags & REQF_NO_RESPONSE) {
        p = put_error_status(p, NO_RESPONSE_MSG, sizeof(NO_RESPONSE_MSG) - 1);
    } else if (r->status >= 500) {
        p = put_error_status(p, "", 0);
    } else if (grpc_error != NULL) {
        p = put_error_status(p, grpc_error, strlen(grpc_error));
    } else if (!grpc && (r->h2_flags & (H2F_RST | H2F_GOAWAY))) {
        char msg[40]; /* "stream ended by " + rst_stream or goaway */
        int n = snprintf(msg, sizeof(msg), "stream ended by %s", ended);
        p = put_error_status(p, msg, (size_t)n);
    }
    return span_body(stack, buf, p, beyond);
}

/* Whether this record's spans are past server_span: CUDA sums are the Python path's. */
static int cuda_sums(const struct http_record *r, unsigned on)
{
    return (on & SIGM_WORKSET) && (on & SIGM_CUDA) && (r->ws_flags & WSF_TRACKED)
           && (r->ws_flags & WSF_CUDA);
}

/* server_span(rec, prefixes, make_prefix, trace_id, span_id, parent_id, trace_flags,
 *             clock_offset_ns, endpoints, server_addr, client_addr, extra, gpu, plan)
 *   rec: the decoded HttpRecord (any buffer of the struct's size);
 *   prefixes, make_prefix: see request_prefix (one dict per span kind: the name differs);
 *   endpoints: None or an object with local_addr, local_port, peer_addr, peer_port;
 *   server_addr, client_addr: str -> that attribute's field (bytes);
 *   extra: the fields from tracejoin.service_name.source to .traceparent.rejected;
 *   gpu: the tracejoin.gpu.* fields; plan: (signal bits, TLB flush fallback, recvq child
 *   threshold ns, runq child threshold ns).
 * -> (body, whether child spans may follow), or None: take the Python path. */
static PyObject *server_span(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 14) {
        PyErr_Format(PyExc_TypeError, "server_span takes 14 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *prefixes = args[1], *make = args[2], *ep = args[8];
    struct span_in in = {.extra = args[11], .gpu = args[12]};
    uint64_t recvq_threshold, runq_threshold;
    if (!PyDict_CheckExact(prefixes)) {
        PyErr_SetString(PyExc_TypeError, "prefixes must be a dict");
        return NULL;
    }
    if (plan_arg(args[13], &in, &recvq_threshold, &runq_threshold) < 0)
        return NULL;
    if (arg_bytes(in.extra, "extra") < 0 || arg_bytes(in.gpu, "gpu") < 0)
        return NULL;
    if (arg_u64(args[3], &in.trace_lo) < 0 || arg_u64(args[4], &in.span_id) < 0
        || arg_u64(args[5], &in.parent_id) < 0 || arg_u64(args[6], &in.trace_flags) < 0)
        return NULL;
    PyObject *hi = PyNumber_Rshift(args[3], k64);
    if (hi == NULL)
        return NULL;
    int err = arg_u64(hi, &in.trace_hi);
    Py_DECREF(hi);
    if (err < 0)
        return NULL;
    long long offset = PyLong_AsLongLong(args[7]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    in.offset = (uint64_t)offset;

    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL, *prefix[3] = {NULL, NULL, NULL}, *body = NULL;
    if (view.len < (Py_ssize_t)sizeof(struct http_record)) {
        PyErr_SetString(PyExc_ValueError, "rec is shorter than struct http_record");
        goto out;
    }
    const struct http_record *r = view.buf;
    if (cuda_sums(r, in.signals)) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    int grpc = (r->h2_flags & H2F_STREAM) && r->grpc_status;
    if (request_prefix(r, grpc, prefixes, make, prefix) < 0)
        goto out;
    if (ep != Py_None) {
        int got = endpoint(ep, "local_addr", "local_port", args[9], &in.saddr, &in.lport);
        if (got == 0)
            got = endpoint(ep, "peer_addr", "peer_port", args[10], &in.caddr, &in.rport);
        if (got < 0)
            goto out;
        if (got > 0) {
            result = Py_NewRef(Py_None);
            goto out;
        }
    }
    body = write_span(r, prefix, &in);
    if (body == NULL || body == Py_None) {
        result = body;
        body = NULL;
        goto out;
    }
    uint64_t arrival = r->arrival_ns;
    int queued = 0 < arrival && arrival <= r->read_ns;
    int tracked = (in.signals & SIGM_WORKSET) && (r->ws_flags & WSF_TRACKED);
    int children
        = needs_children(r, in.signals, queued, tracked, recvq_threshold, runq_threshold);
    result = PyTuple_Pack(2, body, children ? Py_True : Py_False);
out:
    Py_XDECREF(body);
    for (int i = 0; i < 3; i++)
        Py_XDECREF(prefix[i]);
    Py_XDECREF(in.saddr);
    Py_XDECREF(in.caddr);
    PyBuffer_Release(&view);
    return result;
}

/* spans._helper_spans for one work-set member: an INTERNAL child of the server span
 * (in->span_id) from when the thread joined the set until it left it (or the response ended).
 * fields: (its name field, its thread.name attribute field), made by the caller. New bytes;
 * Py_None (new ref) when a value is beyond int64; NULL with an exception set. */
static PyObject *write_helper(const struct http_record *r, const struct ws_member *m,
                              const struct span_in *in, uint64_t span_id, PyObject *fields)
{
    PyObject *name = PyTuple_GET_ITEM(fields, 0), *thread = PyTuple_GET_ITEM(fields, 1);
    char stack[STACK_SPAN];
    char *buf = span_buf(
        stack, (size_t)(PyBytes_GET_SIZE(name) + PyBytes_GET_SIZE(thread)) + OWN_BYTES_MAX);
    if (buf == NULL)
        return NULL;
    char *p = buf;
    int beyond = 0;
    unsigned on = in->signals;
    uint64_t end = m->leave_ns ? m->leave_ns : r->end_ns;
    if (end < m->join_ns)
        end = m->join_ns;
    p = put_head(p, in, span_id, in->span_id, m->join_ns + in->offset, end + in->offset);
    p = put_bytes(p, name);
    *p++ = 0x30; /* Span.kind: INTERNAL */
    *p++ = 0x01;
    TRUE_ATTR("tracejoin.interval.kernel_measured");
    INT_ATTR("thread.id", m->tid);
    p = put_bytes(p, thread);
    if (m->pid)
        INT_ATTR("process.pid", m->pid);
    INT_ATTR("tracejoin.work.on_cpu_ns", m->oncpu_ns);
    if (m->shared_oncpu_ns)
        INT_ATTR(SHARED "on_cpu_ns", m->shared_oncpu_ns);
    if (on & SIGM_SCHED)
        INT_ATTR("tracejoin.sched.runq_wait_ns", m->runq_ns);
    if (on & SIGM_FAULTS) {
        INT_ATTR("tracejoin.mm.minor_faults", m->minflt);
        INT_ATTR("tracejoin.mm.major_faults", m->majflt);
    }
    if (r->flags & REQF_TLB_HW) { /* spans._tlb_names */
        INT_ATTR("tracejoin.tlb.dtlb_load_misses", m->tlb_a);
        INT_ATTR("tracejoin.tlb.itlb_load_misses", m->tlb_b);
    } else if (in->tlb_fallback) {
        INT_ATTR("tracejoin.tlb.flushes", m->tlb_a);
        INT_ATTR("tracejoin.tlb.full_flushes", m->tlb_b);
    }
    return span_body(stack, buf, p, beyond);
}

/* ---- spans_batch ---------------------------------------------------------------------- */

#define CONN_CACHE_MAX 65536 /* connections' address fields kept (cleared when full) */
#define PID_MEMO 8           /* processes resolved once per batch */

#define IDS_PER_RECORD (1 + WS_SLOTS) /* the server span's, then each helper's */

struct batch_ctx {
    PyObject *prefixes[2], *makers[2]; /* by span kind: [0] SERVER, [1] INTERNAL (instrumented) */
    PyObject *resolve, *conns, *conn_fields, *span_type, *gpu;
    PyObject *helper_fields, *helpers; /* the maker, and its answers in this call */
    PyObject *meta; /* None, or a list: per record written, (pid, start, end, spans) */
    const unsigned char *ids;
    struct span_in in;
    uint64_t recvq_threshold, runq_threshold;
    int npids;
    uint32_t pids[PID_MEMO];
    PyObject *served[PID_MEMO]; /* resolve(pid)'s answer (None: the stages' to make) */
};

/* resolve(pid), once per pid per batch (the resolver memoizes across batches): borrowed from
 * the context, NULL with an exception set. */
static PyObject *served_for(struct batch_ctx *c, uint32_t pid)
{
    for (int i = 0; i < c->npids; i++)
        if (c->pids[i] == pid)
            return c->served[i];
    PyObject *got = PyObject_CallFunction(c->resolve, "I", (unsigned)pid);
    if (got == NULL)
        return NULL;
    if (got != Py_None
        && (!PyTuple_CheckExact(got) || PyTuple_GET_SIZE(got) != 3
            || !PyBytes_CheckExact(PyTuple_GET_ITEM(got, 1)))) {
        Py_DECREF(got);
        PyErr_SetString(PyExc_TypeError, "resolve must return (resource, bytes, bool) or None");
        return NULL;
    }
    if (c->npids == PID_MEMO) { /* more processes than that in one batch: forget the first */
        Py_DECREF(c->served[0]);
        memmove(c->pids, c->pids + 1, (PID_MEMO - 1) * sizeof(c->pids[0]));
        memmove(c->served, c->served + 1, (PID_MEMO - 1) * sizeof(c->served[0]));
        c->npids--;
    }
    c->pids[c->npids] = pid;
    c->served[c->npids++] = got;
    return got;
}

/* The connection's (server.address field, client.address field), kept per conn_id: a new ref,
 * NULL with an exception set. */
static PyObject *conn_addresses(struct batch_ctx *c, const struct http_record *r)
{
    PyObject *key = PyLong_FromUnsignedLongLong(r->conn_id);
    if (key == NULL)
        return NULL;
    PyObject *got = r->conn_id ? PyDict_GetItemWithError(c->conns, key) : NULL;
    if (got != NULL) {
        Py_DECREF(key);
        return Py_NewRef(got);
    }
    if (PyErr_Occurred())
        goto fail;
    got = PyObject_CallFunction(c->conn_fields, "By#y#", (unsigned char)r->family,
                                (const char *)r->laddr, (Py_ssize_t)sizeof(r->laddr),
                                (const char *)r->raddr, (Py_ssize_t)sizeof(r->raddr));
    if (got == NULL)
        goto fail;
    if (!PyTuple_CheckExact(got) || PyTuple_GET_SIZE(got) != 2
        || !PyBytes_CheckExact(PyTuple_GET_ITEM(got, 0))
        || !PyBytes_CheckExact(PyTuple_GET_ITEM(got, 1))) {
        Py_DECREF(got);
        PyErr_SetString(PyExc_TypeError, "conn_fields must return (bytes, bytes)");
        goto fail;
    }
    if (r->conn_id) { /* 0: the kernel could not number it */
        if (PyDict_GET_SIZE(c->conns) >= CONN_CACHE_MAX)
            PyDict_Clear(c->conns);
        if (PyDict_SetItem(c->conns, key, got) < 0) {
            Py_DECREF(got);
            goto fail;
        }
    }
    Py_DECREF(key);
    return got;
fail:
    Py_DECREF(key);
    return NULL;
}

/* helper_fields(member pid, comm) for a work-set member, once per call: borrowed (from
 * c->helpers), NULL with an exception set. */
static PyObject *helper_fields_for(struct batch_ctx *c, const struct ws_member *m)
{
    char kb[4 + sizeof(m->comm)];
    memcpy(kb, &m->pid, 4);
    memcpy(kb + 4, m->comm, sizeof(m->comm));
    PyObject *key = PyBytes_FromStringAndSize(kb, sizeof(kb));
    if (key == NULL)
        return NULL;
    PyObject *got = PyDict_GetItemWithError(c->helpers, key); /* borrowed */
    if (got == NULL && !PyErr_Occurred()) {
        got = PyObject_CallFunction(c->helper_fields, "Iy#", (unsigned)m->pid, m->comm,
                                    (Py_ssize_t)sizeof(m->comm));
        if (got != NULL && got != Py_None
            && (!PyTuple_CheckExact(got) || PyTuple_GET_SIZE(got) != 2
                || !PyBytes_CheckExact(PyTuple_GET_ITEM(got, 0))
                || !PyBytes_CheckExact(PyTuple_GET_ITEM(got, 1)))) {
            Py_DECREF(got);
            got = NULL;
            PyErr_SetString(PyExc_TypeError, "helper_fields must return (bytes, bytes) or None");
        }
        if (got != NULL) {
            int bad = PyDict_SetItem(c->helpers, key, got);
            Py_DECREF(got); /* the dict holds it */
            if (bad < 0)
                got = NULL;
        }
    }
    Py_DECREF(key);
    return got;
}

/* One ring record -> its server span (an instance of span_type: resource, body), appended to
 * spans, with its work set's helper spans after it. 0: written; 1: not the common case, left
 * to the stages; -1: an exception is set. The common case: an HTTP/1.x or HTTP/2 record that
 * decode_http reads as it is (long enough, no Huffman-coded value to decode, no CUDA sums), one
 * plain sampled version-00 traceparent, the tuple carried, no child span but its helpers', and
 * a process the resolver answers for. */
static int batch_record(struct batch_ctx *c, PyObject *item, Py_ssize_t i, PyObject *spans,
                        struct http_record *r)
{
    if (!PyBytes_CheckExact(item))
        return 1;
    Py_ssize_t len = PyBytes_GET_SIZE(item);
    const char *data = PyBytes_AS_STRING(item);
    if (len < (Py_ssize_t)REC_HTTP_FIXED_SIZE || data[0] != REC_HTTP)
        return 1;
    size_t n = (size_t)len < sizeof(*r) ? (size_t)len : sizeof(*r);
    memcpy(r, data, n);
    memset((char *)r + n, 0, sizeof(*r) - n);
    unsigned nslots = r->ws_nslots < WS_SLOTS ? r->ws_nslots : WS_SLOTS;
    if (n < REC_HTTP_FIXED_SIZE + nslots * sizeof(r->members[0]))
        return 1; /* short: the stages count it */
    if ((r->ws_flags & WSF_CUDA) || (r->h2_flags & (H2F_TP_HUFF | H2F_PATH_HUFF | H2F_METHOD_HUFF))
        || !(r->flags & REQF_TUPLE))
        return 1;
    struct span_in in = c->in;
    if (!plain_traceparent_ids(r, &in.trace_hi, &in.trace_lo, &in.parent_id, &in.trace_flags)
        || !(in.trace_flags & 0x01))
        return 1; /* every other traceparent (and its counters) is correlate's */
    int queued = 0 < r->arrival_ns && r->arrival_ns <= r->read_ns;
    int tracked = (in.signals & SIGM_WORKSET) && (r->ws_flags & WSF_TRACKED);
    /* a long receive-queue or run-queue wait's child: the stages' (the helpers' are below) */
    if (needs_children(r, in.signals, queued, 0, c->recvq_threshold, c->runq_threshold))
        return 1;
    const unsigned char *ids = c->ids + 8 * IDS_PER_RECORD * i;
    memcpy(&in.span_id, ids, 8);
    if (in.span_id == 0)
        return 1;
    PyObject *served = served_for(c, r->pid); /* borrowed */
    if (served == NULL)
        return -1;
    if (served == Py_None)
        return 1;
    int kind = PyObject_IsTrue(PyTuple_GET_ITEM(served, 2));
    if (kind < 0)
        return -1;
    in.extra = PyTuple_GET_ITEM(served, 1);
    PyObject *addrs = conn_addresses(c, r);
    if (addrs == NULL)
        return -1;
    in.saddr = PyTuple_GET_ITEM(addrs, 0);
    in.caddr = PyTuple_GET_ITEM(addrs, 1);
    in.lport = r->lport;
    in.rport = r->rport;
    PyObject *prefix[3] = {NULL, NULL, NULL}, *bodies[IDS_PER_RECORD] = {NULL};
    int rc = -1, nbodies = 0;
    int grpc = (r->h2_flags & H2F_STREAM) && r->grpc_status;
    if (request_prefix(r, grpc, c->prefixes[kind], c->makers[kind], prefix) < 0)
        goto out;
    /* every span of the record first, so that one the stages must write leaves none here */
    PyObject *body = write_span(r, prefix, &in);
    for (unsigned k = 0; body != NULL && body != Py_None; k++) {
        bodies[nbodies++] = body;
        while (tracked && k < nslots && !r->members[k].join_ns)
            k++; /* a slot never joined: no span, no id (as _helper_spans) */
        if (!tracked || k >= nslots) {
            body = NULL;
            break;
        }
        uint64_t helper_id;
        memcpy(&helper_id, ids + 8 * nbodies, 8);
        PyObject *fields = helper_id ? helper_fields_for(c, &r->members[k]) : Py_None;
        if (fields == NULL)
            goto out;
        body = fields == Py_None ? Py_NewRef(Py_None)
                                 : write_helper(r, &r->members[k], &in, helper_id, fields);
    }
    if (body != NULL) { /* Py_None: a value beyond int64 or a helper left: the stages' */
        Py_DECREF(body);
        rc = 1;
        goto out;
    }
    if (PyErr_Occurred())
        goto out;
    rc = 0;
    if (c->meta != Py_None) { /* what a GPU join needs: its process and its times (monotonic) */
        uint64_t read = r->read_ns, arrival = r->arrival_ns;
        uint64_t start = queued ? arrival : read, end = r->end_ns > read ? r->end_ns : read;
        PyObject *m = Py_BuildValue("(IKKi)", (unsigned)r->pid, (unsigned long long)start,
                                    (unsigned long long)end, nbodies);
        rc = m == NULL || PyList_Append(c->meta, m) < 0 ? -1 : 0;
        Py_XDECREF(m);
    }
    for (int k = 0; k < nbodies && rc == 0; k++) {
        PyObject *span = PyType_GenericAlloc((PyTypeObject *)c->span_type, 2);
        if (span == NULL) {
            rc = -1;
            break;
        }
        PyTuple_SET_ITEM(span, 0, Py_NewRef(PyTuple_GET_ITEM(served, 0)));
        PyTuple_SET_ITEM(span, 1, bodies[k]);
        bodies[k] = NULL;
        rc = PyList_Append(spans, span) < 0 ? -1 : 0;
        Py_DECREF(span);
    }
out:
    for (int k = 0; k < nbodies; k++)
        Py_XDECREF(bodies[k]);
    for (int k = 0; k < 3; k++)
        Py_XDECREF(prefix[k]);
    Py_DECREF(addrs);
    return rc;
}

/* spans_batch(records, spans, rest, prefixes, makers, resolve, conns, conn_fields, span_type,
 *             clock_offset_ns, ids, plan)
 *   records: the ring's records (bytes); spans: list the common records' server spans are
 *   appended to; rest: list every other record is appended to, in order, for the stages;
 *   prefixes, makers: (SERVER, INTERNAL) pairs of request_prefix's dict and maker;
 *   resolve(pid) -> (resource, extra fields, instrumented) or None (the stages make its spans);
 *   conns: dict conn_id -> conn_fields' answer, kept here;
 *   conn_fields(family, laddr, raddr) -> (server.address field, client.address field);
 *   span_type: EncodedSpan (a 2-tuple type: resource, body); ids: 8 random bytes for each of
 *   a record's IDS_PER_RECORD span ids (the server span's, then its helpers'); plan: as
 *   server_span's; helper_fields(member pid, comm) -> (the helper span's name field,
 *   its thread.name field), or None (the stages write that record); meta: None, or a list each
 *   record written appends (pid, start, end, its spans) to, its times kernel-monotonic ns (what
 *   the pipeline's GPU join needs).
 * -> the number of spans appended. */
static PyObject *spans_batch(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 14) {
        PyErr_Format(PyExc_TypeError, "spans_batch takes 14 arguments (%zd given)", nargs);
        return NULL;
    }
    PyObject *records = args[0], *spans = args[1], *rest = args[2], *prefixes = args[3],
             *makers = args[4], *ids = args[10];
    struct batch_ctx c = {
        .resolve = args[5], .conns = args[6], .conn_fields = args[7], .span_type = args[8],
        .helper_fields = args[12], .meta = args[13],
    };
    if (c.meta != Py_None && !PyList_CheckExact(c.meta)) {
        PyErr_SetString(PyExc_TypeError, "meta must be None or a list");
        return NULL;
    }
    if (!PyList_CheckExact(records) || !PyList_CheckExact(spans) || !PyList_CheckExact(rest)) {
        PyErr_SetString(PyExc_TypeError, "records, spans and rest must be lists");
        return NULL;
    }
    if (!PyTuple_CheckExact(prefixes) || PyTuple_GET_SIZE(prefixes) != 2
        || !PyTuple_CheckExact(makers) || PyTuple_GET_SIZE(makers) != 2) {
        PyErr_SetString(PyExc_TypeError, "prefixes and makers must be pairs");
        return NULL;
    }
    for (int k = 0; k < 2; k++) {
        c.prefixes[k] = PyTuple_GET_ITEM(prefixes, k);
        c.makers[k] = PyTuple_GET_ITEM(makers, k);
        if (!PyDict_CheckExact(c.prefixes[k])) {
            PyErr_SetString(PyExc_TypeError, "prefixes must be dicts");
            return NULL;
        }
    }
    if (!PyDict_CheckExact(c.conns)) {
        PyErr_SetString(PyExc_TypeError, "conns must be a dict");
        return NULL;
    }
    if (!PyType_Check(c.span_type)
        || !PyType_IsSubtype((PyTypeObject *)c.span_type, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "span_type must be a tuple type");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(records);
    if (!PyBytes_CheckExact(ids) || PyBytes_GET_SIZE(ids) < 8 * IDS_PER_RECORD * n) {
        PyErr_Format(PyExc_ValueError, "ids must be bytes, %d per record", 8 * IDS_PER_RECORD);
        return NULL;
    }
    c.ids = (const unsigned char *)PyBytes_AS_STRING(ids);
    long long offset = PyLong_AsLongLong(args[9]);
    if (offset == -1 && PyErr_Occurred())
        return NULL;
    c.in.offset = (uint64_t)offset;
    c.in.gpu = PyBytes_FromStringAndSize(NULL, 0);
    c.helpers = PyDict_New();
    if (c.in.gpu == NULL || c.helpers == NULL
        || plan_arg(args[11], &c.in, &c.recvq_threshold, &c.runq_threshold) < 0) {
        Py_XDECREF(c.in.gpu);
        Py_XDECREF(c.helpers);
        return NULL;
    }
    struct http_record *r = PyMem_Malloc(sizeof(*r));
    Py_ssize_t written = 0;
    int rc = r == NULL ? -1 : 0;
    if (r == NULL)
        PyErr_NoMemory();
    for (Py_ssize_t i = 0; rc >= 0 && i < n; i++) {
        PyObject *item = PyList_GET_ITEM(records, i);
        rc = batch_record(&c, item, i, spans, r);
        if (rc == 0)
            written++;
        else if (rc == 1 && PyList_Append(rest, item) < 0)
            rc = -1;
    }
    PyMem_Free(r);
    Py_DECREF(c.in.gpu);
    Py_DECREF(c.helpers);
    for (int k = 0; k < c.npids; k++)
        Py_DECREF(c.served[k]);
    return rc < 0 ? NULL : PyLong_FromSsize_t(written);
}

static PyMethodDef methods[] = {
    {"join", join, METH_O, "The parts of one OTLP Span message -> its bytes (see span_bytes)."},
    {"server_span", (PyCFunction)(void (*)(void))server_span, METH_FASTCALL,
     "A record's server span -> (bytes, children may follow), or None (see span_bytes)."},
    {"spans_batch", (PyCFunction)(void (*)(void))spans_batch, METH_FASTCALL,
     "A batch of ring records -> the common ones' spans; the rest left (see span_bytes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_span_bytes", "span_bytes.py, compiled.", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__span_bytes(void)
{
    k64 = PyLong_FromLong(64);
    if (k64 == NULL)
        return NULL;
    PyObject *mod = PyModule_Create(&module);
    if (mod != NULL && PyModule_AddIntConstant(mod, "IDS_PER_RECORD", IDS_PER_RECORD) < 0)
        Py_CLEAR(mod);
    return mod;
}
