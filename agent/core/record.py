"""The kernel's record and constants, mirrored from bpf/http_record.h (the C <-> Python contract).

Ground floor: imports nothing of ours, so every layer (decode, spans, exporters, bench) can use
the layout and flags. tests/test_decode.py compiles the header and checks every `#define` and
the struct's size and offsets against this module: a constant changed on one side only fails
there.
"""

from __future__ import annotations

import ctypes

from tracejoin.core.text import http_method

REC_HTTP = 1  # byte 0 of every ring-buffer record is its type

HTTP_METHOD_MAX = 16
HTTP_PATH_MAX = 96
TP_CAP = 56
RUNQ_SLOTS = 4
WS_SLOTS = 4
WS_MAX = 8
WS_REFS = 4

# record flags (REQF_*)
REQF_TP_WINDOW = 0x0001
REQF_HDR_DONE = 0x0002
REQF_NO_RESPONSE = 0x0004
REQF_RESP_UNTERM = 0x0008
REQF_PATH_TRUNC = 0x0010
REQF_TP_SPLIT = 0x0020
REQF_TUPLE = 0x0040
REQF_FIRST_ON_CONN = 0x0080
REQF_TLB_HW = 0x0100
REQF_RESP_TRUNC = 0x0200
REQF_METHOD_OTHER = 0x0400
REQF_TARGET_ABS = 0x0800
REQF_PATH_PARAMS = 0x1000

H2F_STREAM = 0x0001
H2F_TP_HUFF = 0x0002
H2F_PATH_HUFF = 0x0004
H2F_METHOD_HUFF = 0x0008
H2F_RST = 0x0010
H2F_GOAWAY = 0x0020
H2F_CLOSED = 0x0040
H2F_UNRESOLVED = 0x0080
H2F_LOST = 0x0100

# limits of the kernel's maps and windows
HDR_WINDOW = 4096
MAX_PENDING = 8
LRU_ENTRIES = 16384
RINGBUF_PAGES = 512
H2_CONNS = 4096
WS_ENTRIES = 4096

# signals a work-set member accumulates (WSIG_*): indices into HttpRecord.shared
WSIG_ONCPU = 0
WSIG_RUNQ = 1
WSIG_OFFCPU = 2
WSIG_MINFLT = 3
WSIG_MAJFLT = 4
WSIG_TLB_A = 5
WSIG_TLB_B = 6
WSIG_SWITCHES = 7
WSIG_COUNT = 8

# HttpRecord.ws_flags (WSF_*)
WSF_TRACKED = 0x01
WSF_CAP = 0x02
WSF_NO_GAP = 0x04
WSF_STATS = 0x08
WSF_CUDA = 0x80

# CUDA calls of a request's work set (CSIG_*): indices into CudaBlock.own/shared
CSIG_MEMCPY_H2D = 0
CSIG_MEMCPY_D2H = 1
CSIG_MEMCPY_D2D = 2
CSIG_MEMCPY_OTHER = 3
CSIG_MEMCPY_CALLS = 4
CSIG_SYNC_NS = 5
CSIG_SYNC_CALLS = 6
CSIG_GRAPH_LAUNCHES = 7
CSIG_LAUNCHES = 8
CSIG_ALLOC_BYTES = 9
CSIG_ALLOC_CALLS = 10
CSIG_FREE_CALLS = 11
CSIG_ERRORS = 12
CSIG_COUNT = 13
CUDA_WAIT_SLOTS = 4

# slots of the `progs` prog_array
PROG_SCAN_REQ = 0
PROG_SCAN_RESP = 1
PROG_RUN_NOTES = 2
PROG_H2_RD = 3
PROG_H2_WR = 4
PROG_H2_END = 5
PROG_COUNT = 6

# indices of the per-CPU `counters` map (CNT_*)
CNT_RECORDS_SUBMITTED = 0
CNT_RINGBUF_FULL = 1
CNT_PIPELINE_SLOTS_FULL = 2
CNT_NON_HTTP_CONNECTIONS = 3
CNT_REQUEST_STATE_LOST = 4
CNT_READ_COPY_FAILED = 5
CNT_UNTRUSTED_CONTENT_LENGTH = 6
CNT_UNTRUSTED_TRANSFER_ENCODING = 7
CNT_UNTRUSTED_TE_AND_CL = 8
CNT_UNTRUSTED_CHUNKED = 9
CNT_UNTRUSTED_HEADERS_TOO_LONG = 10
CNT_UNTRUSTED_REQUEST_LINE = 11
CNT_UNTRUSTED_RESPONSE_WITHOUT_REQUEST = 12
CNT_UNTRUSTED_EARLY_RESPONSE = 13
CNT_UNTRUSTED_RESPONSE_INVALID = 14
CNT_UNTRUSTED_PIPELINE_OVERFLOW = 15
CNT_UNTRUSTED_UNSCANNED = 16
CNT_WORKSET_FULL = 20
CNT_WORKSET_LOST = 21
CNT_WORKSET_REFS_FULL = 22
CNT_SAMPLED_OUT_BUDGET = 23
CNT_UNSAMPLED_AGGREGATED = 24
CNT_NO_PARENT_AGGREGATED = 25
CNT_H2_CONNECTIONS = 32
CNT_H2_STREAMS_FULL = 33
CNT_H2_FRAME_INVALID = 34
CNT_H2_HPACK_INVALID = 35
CNT_H2_UNSCANNED = 36
CNT_H2_PREFACE_BAD = 37
CNT_H2_DYN_UNRESOLVED = 38
CNT_H2_DYN_BEYOND = 39
CNT_H2_STATE_LOST = 40
CNT_H2_HEADERS_CUT = 41
CNT_H2_UNANSWERED = 42
CNT_H2_MALFORMED = 43
CNT_H2_FIELD_UNRESOLVED = 44
CNT_H2_NOT_LOADED = 45
CNT_CUDA_UNATTRIBUTED = 46
CNT_CUDA_NESTED = 47
CNT_CUDA_ACC_LOST = 48
CNT_OTLP_CONNECTS = 49
CNT_MAX = 64

# CNT_FOO is exported as `kernel_foo`: index -> name, and each name's help text.
KERNEL_COUNTERS: dict[int, str] = {
    CNT_RECORDS_SUBMITTED: "records_submitted",
    CNT_RINGBUF_FULL: "ringbuf_full",
    CNT_PIPELINE_SLOTS_FULL: "pipeline_slots_full",
    CNT_NON_HTTP_CONNECTIONS: "non_http_connections",
    CNT_REQUEST_STATE_LOST: "request_state_lost",
    CNT_READ_COPY_FAILED: "read_copy_failed",
    CNT_UNTRUSTED_CONTENT_LENGTH: "untrusted_content_length",
    CNT_UNTRUSTED_TRANSFER_ENCODING: "untrusted_transfer_encoding",
    CNT_UNTRUSTED_TE_AND_CL: "untrusted_te_and_cl",
    CNT_UNTRUSTED_CHUNKED: "untrusted_chunked",
    CNT_UNTRUSTED_HEADERS_TOO_LONG: "untrusted_headers_too_long",
    CNT_UNTRUSTED_REQUEST_LINE: "untrusted_request_line",
    CNT_UNTRUSTED_RESPONSE_WITHOUT_REQUEST: "untrusted_response_without_request",
    CNT_UNTRUSTED_EARLY_RESPONSE: "untrusted_early_response",
    CNT_UNTRUSTED_RESPONSE_INVALID: "untrusted_response_invalid",
    CNT_UNTRUSTED_PIPELINE_OVERFLOW: "untrusted_pipeline_overflow",
    CNT_UNTRUSTED_UNSCANNED: "untrusted_unscanned",
    CNT_WORKSET_FULL: "workset_full",
    CNT_WORKSET_LOST: "workset_lost",
    CNT_WORKSET_REFS_FULL: "workset_refs_full",
    CNT_SAMPLED_OUT_BUDGET: "sampled_out_budget",
    CNT_UNSAMPLED_AGGREGATED: "unsampled_aggregated",
    CNT_NO_PARENT_AGGREGATED: "no_parent_aggregated",
    CNT_H2_CONNECTIONS: "h2_connections",
    CNT_H2_STREAMS_FULL: "h2_streams_full",
    CNT_H2_FRAME_INVALID: "h2_frame_invalid",
    CNT_H2_HPACK_INVALID: "h2_hpack_invalid",
    CNT_H2_UNSCANNED: "h2_unscanned",
    CNT_H2_PREFACE_BAD: "h2_preface_bad",
    CNT_H2_DYN_UNRESOLVED: "h2_dyn_unresolved",
    CNT_H2_DYN_BEYOND: "h2_dyn_beyond",
    CNT_H2_STATE_LOST: "h2_state_lost",
    CNT_H2_HEADERS_CUT: "h2_headers_cut",
    CNT_H2_UNANSWERED: "h2_unanswered",
    CNT_H2_MALFORMED: "h2_malformed",
    CNT_H2_FIELD_UNRESOLVED: "h2_field_unresolved",
    CNT_H2_NOT_LOADED: "h2_not_loaded",
    CNT_CUDA_UNATTRIBUTED: "cuda_unattributed",
    CNT_CUDA_NESTED: "cuda_nested",
    CNT_CUDA_ACC_LOST: "cuda_acc_lost",
    CNT_OTLP_CONNECTS: "otlp_connects",
}
KERNEL_COUNTER_HELP: dict[str, str] = {
    "records_submitted": "Records the kernel tried to emit (one per request)",
    "ringbuf_full": "Records lost in the kernel: the ring buffer had no room",
    "pipeline_slots_full": "Requests not tracked: more than MAX_PENDING open on one connection",
    "non_http_connections": "Connections whose first read was not an HTTP/1.x request",
    "request_state_lost": "Requests whose kernel state was evicted before their response",
    "read_copy_failed": "Buffers the kernel could not copy to scan",
    # Connections whose framing the kernel stopped trusting (no request opened on them after),
    # by reason; counted once per connection.
    "untrusted_content_length": "Connections untrusted: request Content-Length malformed, "
    "duplicate or folded",
    "untrusted_transfer_encoding": "Connections untrusted: request Transfer-Encoding not "
    "ending in chunked, or malformed",
    "untrusted_te_and_cl": "Connections untrusted: a request with both Transfer-Encoding "
    "and Content-Length (framed by Transfer-Encoding)",
    "untrusted_chunked": "Connections untrusted: chunked body syntax error",
    "untrusted_headers_too_long": "Connections untrusted: request headers longer than the "
    "kernel scans (32 KiB)",
    "untrusted_request_line": "Connections untrusted: no request line where the next "
    "request had to start",
    "untrusted_response_without_request": "Connections untrusted: a response with no request open",
    "untrusted_early_response": "Connections untrusted: a response before the request's "
    "headers ended",
    "untrusted_response_invalid": "Connections untrusted: invalid status line or response "
    "Content-Length",
    "untrusted_pipeline_overflow": "Connections untrusted: more pipelined requests open "
    "than the kernel frames (64)",
    "untrusted_unscanned": "Connections untrusted: bytes to frame could not be scanned "
    "(tail-call budget or copy failure)",
    "workset_full": "Wakes not followed: the request's work set already had WS_MAX threads",
    "workset_lost": "Requests whose work set was lost before their response (no work-set values)",
    "workset_refs_full": "Threads that joined more than WS_REFS open work sets at once",
    "sampled_out_budget": "Requests the overload budget's sampling ratio kept in the kernel "
    "(counted and aggregated per endpoint; not a loss)",
    "unsampled_aggregated": "Requests with a valid unsampled traceparent kept in the kernel "
    "(--unsampled follow: no span; aggregated per endpoint, never sent)",
    "no_parent_aggregated": "Requests without a traceparent header kept in the kernel "
    "(--no-parent skip: no span; aggregated per endpoint, never sent)",
    "h2_connections": "Connections that became HTTP/2 (client preface seen)",
    "h2_streams_full": "HTTP/2 streams not tracked: their per-connection slot was taken "
    "(more than 256 open at once)",
    "h2_frame_invalid": "HTTP/2 connections no longer scanned: an invalid frame",
    "h2_hpack_invalid": "HTTP/2 connections no longer scanned: an HPACK block the kernel "
    "could not decode",
    "h2_unscanned": "HTTP/2 connections no longer scanned: bytes to frame could not be "
    "scanned (tail-call budget or copy failure)",
    "h2_preface_bad": "Connections starting 'PRI *' without the HTTP/2 client preface",
    "h2_dyn_unresolved": "HTTP/2 fields referring to a dynamic-table entry whose value the "
    "kernel does not hold (the stream is flagged, no value guessed)",
    "h2_dyn_beyond": "HTTP/2 fields referring to a dynamic-table entry older than the 128 "
    "insertions the kernel tracks",
    "h2_state_lost": "HTTP/2 stream or connection state evicted before the stream ended",
    "h2_headers_cut": "HTTP/2 streams that ended (framing lost, reset, close) before their "
    "request headers did: not emitted, since their traceparent is unknown",
    "h2_unanswered": "HTTP/2 streams not emitted: the server never spoke HTTP/2 on the "
    "connection (no SETTINGS frame: an HTTP/1.x-only server, or none answered)",
    "h2_malformed": "HTTP/2 streams not emitted: the request had no :method or no :path "
    "(malformed, RFC 9113 8.3.1)",
    "h2_field_unresolved": "HTTP/2 streams not emitted: a field referred to a dynamic-table "
    "entry whose value the kernel does not hold, and the stream lacks the traceparent, "
    ":method or :path it may have been (a span would guess its trace or its name)",
    "h2_not_loaded": "Connections that turned HTTP/2 while the HTTP/2 programs were not loaded "
    "(the seconds after ready while they are verified, and at a first start compiled, unless "
    "--http2-before-ready; or for good, when they failed to load): ignored for their whole "
    "life, never half-scanned",
    "cuda_unattributed": "Probed CUDA calls by a thread in no open request's work set "
    "(work outside requests, or a worker that polls: no thread link)",
    "cuda_nested": "Probed CUDA calls made beneath another probed call (a runtime call's "
    "driver call): counted once, by the outer call",
    "cuda_acc_lost": "CUDA calls not added to a request: its CUDA sums could not be created "
    "(or, for a call counted at its entry, its counting program was not in place)",
    "otlp_connects": "TCP connections opened on this host to an OTLP port (--otlp-ports): after "
    "one, the inspector reads network namespaces' TCP tables again (instrumented services)",
}

# the overload budget's in-kernel sampling and the per-endpoint aggregates of what it shed
AGG_BUCKETS = 24
AGG_ENTRIES = 1024
AGG_SHED = 1
AGG_UNSAMPLED = 2
AGG_NO_PARENT = 3


class Sampling(ctypes.Structure):
    """Mirror of struct sampling (the `sampling` array's one entry)."""

    _fields_ = (("bound", ctypes.c_uint64), ("active", ctypes.c_uint32), ("_pad", ctypes.c_uint32))


class Policy(ctypes.Structure):
    """Mirror of struct policy (the `policy` array's one entry): which spanless requests the
    kernel aggregates instead of sending."""

    _fields_ = (
        ("agg_unsampled", ctypes.c_uint8),
        ("agg_no_parent", ctypes.c_uint8),
        ("_pad", ctypes.c_uint8 * 6),
    )


class AggKey(ctypes.Structure):
    """Mirror of struct agg_key."""

    _fields_ = (("pid", ctypes.c_uint32), ("lport", ctypes.c_uint16), ("why", ctypes.c_uint16))


class AggVal(ctypes.Structure):
    """Mirror of struct agg_val: requests, summed latency, log2-µs latency buckets."""

    _fields_ = (
        ("count", ctypes.c_uint64),
        ("sum_ns", ctypes.c_uint64),
        ("hist", ctypes.c_uint64 * AGG_BUCKETS),
    )


class RunqWait(ctypes.Structure):
    _fields_ = (("start_ns", ctypes.c_uint64), ("dur_ns", ctypes.c_uint64))


class WsMember(ctypes.Structure):
    """Mirror of struct ws_member: one helper thread of a request's work set."""

    _fields_ = (
        ("tid", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
        ("comm", ctypes.c_char * 16),
        ("join_ns", ctypes.c_uint64),
        ("leave_ns", ctypes.c_uint64),
        ("oncpu_ns", ctypes.c_uint64),
        ("shared_oncpu_ns", ctypes.c_uint64),
        ("runq_ns", ctypes.c_uint64),
        ("minflt", ctypes.c_uint32),
        ("majflt", ctypes.c_uint32),
        ("tlb_a", ctypes.c_uint32),
        ("tlb_b", ctypes.c_uint32),
    )

    def comm_bytes(self) -> bytes:
        """The thread name as the kernel holds it (up to 16 bytes, NUL-terminated)."""
        raw = ctypes.string_at(ctypes.addressof(self) + WsMember.comm.offset, 16)
        return raw.split(b"\0", 1)[0]


class CudaWait(ctypes.Structure):
    """Mirror of struct cuda_wait: one synchronisation call (api: its row in CUDA_APIS)."""

    _fields_ = (
        ("start_ns", ctypes.c_uint64),
        ("dur_ns", ctypes.c_uint64),
        ("tid", ctypes.c_uint32),
        ("api", ctypes.c_uint16),
        ("shared", ctypes.c_uint16),
    )


class CudaBlock(ctypes.Structure):
    """Mirror of struct cuda_block: the CUDA calls of a request's work set, by CSIG_*."""

    _fields_ = (
        ("own", ctypes.c_uint64 * CSIG_COUNT),
        ("shared", ctypes.c_uint64 * CSIG_COUNT),
        ("waits", CudaWait * CUDA_WAIT_SLOTS),
    )


class HttpRecord(ctypes.Structure):
    """Mirror of struct http_record."""

    _fields_ = (
        ("type", ctypes.c_uint8),
        ("family", ctypes.c_uint8),
        ("method_len", ctypes.c_uint8),
        ("path_len", ctypes.c_uint8),
        ("flags", ctypes.c_uint16),
        ("status", ctypes.c_uint16),
        ("lport", ctypes.c_uint16),
        ("rport", ctypes.c_uint16),
        ("tp_len", ctypes.c_uint16),
        ("tp_count", ctypes.c_uint8),
        ("unspanned", ctypes.c_uint8),
        ("pid", ctypes.c_uint32),
        ("tid", ctypes.c_uint32),
        ("fd", ctypes.c_uint32),
        ("h2_flags", ctypes.c_uint16),
        ("grpc_status", ctypes.c_uint8),
        ("h1_slot", ctypes.c_uint8),  # the kernel's own (its map slot); not read here
        ("conn_id", ctypes.c_uint64),
        ("seq", ctypes.c_uint64),
        ("arrival_ns", ctypes.c_uint64),
        ("read_ns", ctypes.c_uint64),
        ("resp_start_ns", ctypes.c_uint64),
        ("end_ns", ctypes.c_uint64),
        ("est_ns", ctypes.c_uint64),
        ("req_bytes", ctypes.c_uint64),
        ("resp_bytes", ctypes.c_uint64),
        ("laddr", ctypes.c_uint8 * 16),
        ("raddr", ctypes.c_uint8 * 16),
        ("method", ctypes.c_char * HTTP_METHOD_MAX),
        ("path", ctypes.c_char * HTTP_PATH_MAX),
        ("tp", ctypes.c_char * TP_CAP),
        ("runq_ns", ctypes.c_uint64),
        ("runq_max_ns", ctypes.c_uint64),
        ("offcpu_ns", ctypes.c_uint64),
        ("tlb_a", ctypes.c_uint64),
        ("tlb_b", ctypes.c_uint64),
        ("minflt", ctypes.c_uint32),
        ("majflt", ctypes.c_uint32),
        ("nr_switches", ctypes.c_uint32),
        ("retrans", ctypes.c_uint32),
        ("srtt_us", ctypes.c_uint32),
        ("unacked_max", ctypes.c_uint32),
        ("runq", RunqWait * RUNQ_SLOTS),
        ("oncpu_ns", ctypes.c_uint64),
        ("helper_oncpu_ns", ctypes.c_uint64),
        ("unexplained_wait_ns", ctypes.c_uint64),
        ("shared_apportioned_ns", ctypes.c_uint64),
        ("shared", ctypes.c_uint64 * WSIG_COUNT),
        ("ws_threads", ctypes.c_uint16),
        ("ws_processes", ctypes.c_uint16),
        ("ws_shared_with_max", ctypes.c_uint16),
        ("ws_unslotted", ctypes.c_uint16),
        ("ws_refused", ctypes.c_uint16),
        ("ws_nslots", ctypes.c_uint8),
        ("ws_flags", ctypes.c_uint8),
        ("_pad2", ctypes.c_uint32),
        ("members", WsMember * WS_SLOTS),
        ("cuda", CudaBlock),
    )

    def method_str(self) -> str:
        """`http.request.method`: a known method, else "_OTHER" (core.text.http_method judges
        the bytes as sent; the kernel's REQF_METHOD_OTHER says the same from its side)."""
        return http_method(self.method_bytes())[0]

    def method_original(self) -> str | None:
        """`http.request.method_original`: the method as sent when it is not a known one, only
        if it is a valid HTTP token; None otherwise."""
        return http_method(self.method_bytes())[1]

    def method_bytes(self) -> bytes:
        # As path_bytes: the bytes as sent, a NUL included (core.text.http_method judges them).
        raw = ctypes.string_at(ctypes.addressof(self) + HttpRecord.method.offset, HTTP_METHOD_MAX)
        return raw[: min(self.method_len, HTTP_METHOD_MAX)]

    def path_bytes(self) -> bytes:
        # ctypes c_char arrays stop at NUL; the length field is the truth.
        raw = ctypes.string_at(ctypes.addressof(self) + HttpRecord.path.offset, HTTP_PATH_MAX)
        return raw[: min(self.path_len, HTTP_PATH_MAX)]

    def traceparent_bytes(self) -> bytes:
        """The captured value prefix: at most 56 bytes, trailing OWS excluded."""
        raw = ctypes.string_at(ctypes.addressof(self) + HttpRecord.tp.offset, TP_CAP)
        return raw[: min(self.tp_len, TP_CAP)]


# A record ends after its last used work-set member (bpf/http_enrich.h record_size), unless it
# carries CUDA sums (WSF_CUDA): then it is sent whole.
REC_HTTP_FIXED_SIZE = HttpRecord.members.offset
