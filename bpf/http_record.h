/* The C <-> Python contract for the HTTP probes: the record layout and every constant both
 * sides use. agent/core/record.py mirrors it with ctypes; tests/test_decode.py compiles this
 * header and checks the struct's size, every offset and every #define below against the mirror,
 * so change both together. All padding is explicit; no field relies on compiler packing.
 */
#ifndef TRACEJOIN_HTTP_RECORD_H
#define TRACEJOIN_HTTP_RECORD_H

#define REC_HTTP 1            /* byte 0 of every ring-buffer record is its type */

#define HTTP_METHOD_MAX 16    /* the longest method token the kernel accepts */
#define HTTP_PATH_MAX 96      /* path without query string, truncated (REQF_PATH_TRUNC) */
#define TP_CAP 56             /* the 55-byte version-00 traceparent value + the byte after it */
#define RUNQ_SLOTS 4          /* longest run-queue waits kept per request */
#define WS_SLOTS 4            /* helper threads of a work set reported one by one (members[]) */
#define WS_MAX 8              /* threads in one work set, the reader included: the set-size cap */
#define WS_REFS 4             /* open work sets one thread can pass its wakes on to */

/* record flags */
#define REQF_TP_WINDOW     0x0001 /* headers ran past the scan window before their end */
#define REQF_HDR_DONE      0x0002 /* the end of the request headers was seen */
#define REQF_NO_RESPONSE   0x0004 /* connection ended before any response byte */
#define REQF_RESP_UNTERM   0x0008 /* response end not framed (close-delimited or unparsed) */
#define REQF_PATH_TRUNC    0x0010
#define REQF_TP_SPLIT      0x0020 /* the traceparent value spanned reads (still exact) */
#define REQF_TUPLE         0x0040 /* laddr/raddr/ports are known */
#define REQF_FIRST_ON_CONN 0x0080 /* first request seen on this connection: accept wait valid */
#define REQF_TLB_HW        0x0100 /* tlb_* are hardware dTLB/iTLB load misses */
#define REQF_RESP_TRUNC    0x0200 /* a later request or close cut the response short */
#define REQF_METHOD_OTHER  0x0400 /* not a known method; `method` is the raw token (tchar only) */
#define REQF_TARGET_ABS    0x0800 /* absolute-form target: scheme and authority were not copied */
#define REQF_PATH_PARAMS   0x1000 /* ";params" of path segments were not copied */

/* http_record.h2_flags: an HTTP/2 stream (bpf/http2_*.h). Its seq is the stream id; method,
 * path and tp hold the values as HPACK carried them (Huffman-coded where flagged: user space
 * decodes them). A :path never holds its query: a Huffman-coded one is cut where its code could
 * begin a '?' (bpf/http2_scan.h h2_str_byte). */
#define H2F_STREAM      0x0001 /* the record is an HTTP/2 stream */
#define H2F_TP_HUFF     0x0002 /* tp is Huffman-coded (tp_len: its length on the wire) */
#define H2F_PATH_HUFF   0x0004 /* path is Huffman-coded */
#define H2F_METHOD_HUFF 0x0008 /* method is Huffman-coded */
#define H2F_RST         0x0010 /* ended by RST_STREAM (either side) */
#define H2F_GOAWAY      0x0020 /* ended by the server's GOAWAY (above its last stream id) */
#define H2F_CLOSED      0x0040 /* ended by the connection's end */
#define H2F_UNRESOLVED  0x0080 /* a field it needed referred to a dynamic-table entry the
                                * kernel does not hold (counted by reason) */
#define H2F_LOST        0x0100 /* the connection's framing was lost while it was open */

/* Limits user space and the docs reason about (sizes of the kernel's maps and windows). */
#define HDR_WINDOW 4096       /* request bytes scanned for headers, request line included */
#define MAX_PENDING 8         /* requests tracked at once on one connection (pipelining) */
#define LRU_ENTRIES 16384     /* entries of each per-connection / per-thread LRU map */
#define RINGBUF_PAGES 512     /* ring buffer size in 4 KiB pages (2 MiB: ~2,400 full records) */
#define H2_CONNS 4096         /* HTTP/2 connections followed at once (`h2conns` LRU) */
#define WS_ENTRIES 4096       /* work sets of open requests kept at once (`worksets` LRU) */

/* Signals a thread accumulates while it works for a request, by index into tstat.tot/sh and
 * http_record.shared (bpf/http_workset.h). */
#define WSIG_ONCPU 0          /* ns on a CPU */
#define WSIG_RUNQ 1           /* ns runnable, waiting for a CPU */
#define WSIG_OFFCPU 2         /* ns blocked */
#define WSIG_MINFLT 3
#define WSIG_MAJFLT 4
#define WSIG_TLB_A 5          /* as tlb_a: dTLB misses (REQF_TLB_HW) or TLB flushes */
#define WSIG_TLB_B 6          /* as tlb_b: iTLB misses (REQF_TLB_HW) or full flushes */
#define WSIG_SWITCHES 7
#define WSIG_COUNT 8

/* http_record.ws_flags */
#define WSF_TRACKED  0x01     /* the work set was followed from the request's read to its end */
#define WSF_CAP      0x02     /* a thread was refused: the set already had WS_MAX members */
#define WSF_NO_GAP   0x04     /* the reader held no reference to this set (it served more than
                               * WS_REFS at once): unexplained_wait_ns is not measured */
#define WSF_STATS    0x08     /* the reader's counters were taken when the request was read: the
                               * enrichment fields are measured (without it they are not) */
#define WSF_CUDA     0x80     /* the work set made probed CUDA calls: the record is sent whole,
                               * http_record.cuda included (bpf/cuda.h) */

/* CUDA calls a request's work set made (bpf/cuda.h), by index into cuda_block.own/shared. */
#define CSIG_MEMCPY_H2D 0     /* bytes copied host to device */
#define CSIG_MEMCPY_D2H 1     /* ... device to host */
#define CSIG_MEMCPY_D2D 2     /* ... device to device */
#define CSIG_MEMCPY_OTHER 3   /* ... host to host, peer, or inferred from the pointers (Default) */
#define CSIG_MEMCPY_CALLS 4
#define CSIG_SYNC_NS 5        /* host time blocked in synchronisation calls */
#define CSIG_SYNC_CALLS 6
#define CSIG_GRAPH_LAUNCHES 7
#define CSIG_LAUNCHES 8       /* kernel launches (opt-in: probed only with --cuda-launches) */
#define CSIG_ALLOC_BYTES 9
#define CSIG_ALLOC_CALLS 10
#define CSIG_FREE_CALLS 11
#define CSIG_ERRORS 12        /* probed calls that returned an error (their bytes not counted) */
#define CSIG_COUNT 13
#define CUDA_WAIT_SLOTS 4     /* longest synchronisation waits kept per request (child spans) */

/* Indices of the `progs` prog_array: user space loads each scanner into its slot. */
#define PROG_SCAN_REQ 0
#define PROG_SCAN_RESP 1
#define PROG_RUN_NOTES 2      /* a syscall's exit: the openings and endings its scanners noted */
#define PROG_H2_RD 3          /* HTTP/2 frames read (requests): bpf/http2_scan.h */
#define PROG_H2_WR 4          /* HTTP/2 frames written (responses) */
#define PROG_H2_END 5         /* emit HTTP/2 streams that ended */
#define PROG_COUNT 6

struct runq_wait {
    __u64 start_ns;
    __u64 dur_ns;
};

/* One synchronisation call, for a child span: api is its row in bpf/cuda.h CUDA_APIS. */
struct cuda_wait {
    __u64 start_ns;
    __u64 dur_ns;
    __u32 tid;
    __u16 api;
    __u16 shared;          /* 1: the thread also worked for other open requests then */
};

/* What a request's work set asked of CUDA. own[]: calls by member threads that worked for this
 * request alone; shared[]: calls made while the thread also worked for other open requests. */
struct cuda_block {
    __u64 own[CSIG_COUNT];
    __u64 shared[CSIG_COUNT];
    struct cuda_wait waits[CUDA_WAIT_SLOTS]; /* the longest waits; dur_ns 0: unused */
};

/* One helper thread of a request's work set (not the reader). Counters are what it did while it
 * worked for this request alone; shared_oncpu_ns while it also worked for other open requests. */
struct ws_member {
    __u32 tid;
    __u32 pid;
    char  comm[16];        /* the thread's name (comm) when it joined, or when it left by a wake */
    __u64 join_ns;         /* woken into the set */
    __u64 leave_ns;        /* woke the reader (the reply), or the response ended */
    __u64 oncpu_ns;
    __u64 shared_oncpu_ns;
    __u64 runq_ns;
    __u32 minflt;
    __u32 majflt;
    __u32 tlb_a;           /* as http_record.tlb_a */
    __u32 tlb_b;
};

struct http_record {
    __u8  type;            /* REC_HTTP */
    __u8  family;          /* AF_INET / AF_INET6; 0 when the tuple is unknown */
    __u8  method_len;
    __u8  path_len;
    __u16 flags;           /* REQF_* */
    __u16 status;          /* response status code; 0 when none was seen */
    __u16 lport;           /* server (local) port, host order */
    __u16 rport;           /* client port */
    __u16 tp_len;          /* traceparent value length without trailing OWS (saturating) */
    __u8  tp_count;        /* traceparent headers seen (saturating at 255) */
    __u8  unspanned;       /* AGG_* the kernel keeps it under (never sent then); 0: send it */
    __u32 pid;             /* process (tgid) that read the request */
    __u32 tid;             /* thread that read the request */
    __u32 fd;              /* fd of the read, to resolve a pre-existing connection's tuple */
    __u16 h2_flags;        /* H2F_*: 0 for HTTP/1.x (bpf/http2_scan.h) */
    __u8  grpc_status;     /* HTTP/2: grpc-status from the trailers + 1; 0 when none was seen */
    __u8  h1_slot;         /* kernel-private: an HTTP/1.x request's slot in `reqs` (bpf/http.c) */
    __u64 conn_id;         /* opaque, per-connection; never a kernel address */
    __u64 seq;             /* request number on this connection, from 0 */
    __u64 arrival_ns;      /* first request byte queued on the socket (CLOCK_MONOTONIC); 0 unknown */
    __u64 read_ns;         /* first read of the request */
    __u64 resp_start_ns;   /* first response byte written; 0 none */
    __u64 end_ns;          /* last response byte written (or the close that ended it) */
    __u64 est_ns;          /* handshake completed (first request on a connection only) */
    __u64 req_bytes;
    __u64 resp_bytes;
    __u8  laddr[16];       /* IPv4 in the first 4 bytes */
    __u8  raddr[16];
    char  method[HTTP_METHOD_MAX];
    char  path[HTTP_PATH_MAX];
    char  tp[TP_CAP];
    /* --- kernel enrichment, deltas over the request on the reading thread --- */
    __u64 runq_ns;         /* runnable but waiting for a CPU */
    __u64 runq_max_ns;     /* longest single such wait */
    __u64 offcpu_ns;       /* blocked (sleeping) off-CPU */
    __u64 tlb_a;           /* REQF_TLB_HW: dTLB load misses; else tlb:tlb_flush events */
    __u64 tlb_b;           /* REQF_TLB_HW: iTLB load misses; else full (all-page) flushes */
    __u32 minflt;
    __u32 majflt;
    __u32 nr_switches;     /* involuntary + voluntary switches of the thread */
    __u32 retrans;         /* TCP retransmissions on the connection during the request */
    __u32 srtt_us;         /* last smoothed RTT seen on the connection (tcp:tcp_probe); 0 none */
    __u32 unacked_max;     /* most bytes sent but unacknowledged (tcp:tcp_probe) during the response */
    struct runq_wait runq[RUNQ_SLOTS];
    /* --- the work set (bpf/http_workset.h): the reader plus the threads its members woke while
     * the request was open, until they woke the reader (the reply) or the response ended. With
     * WSF_TRACKED the enrichment fields above are sums over the work set of what each thread did
     * while it worked for this request alone; what a thread did while it also worked for other
     * open requests is in shared[], never in them. --- */
    __u64 oncpu_ns;        /* on a CPU, summed over the work set (not shared) */
    __u64 helper_oncpu_ns; /* ... the part by threads other than the reader */
    __u64 unexplained_wait_ns; /* reader blocked while no other member was runnable */
    __u64 shared_apportioned_ns; /* shared[WSIG_ONCPU] split evenly among the requests sharing it */
    __u64 shared[WSIG_COUNT];    /* by WSIG_*: counted while the thread also served others */
    __u16 ws_threads;      /* members, the reader included */
    __u16 ws_processes;    /* distinct processes among them */
    __u16 ws_shared_with_max; /* most other open requests sharing a member thread */
    __u16 ws_unslotted;    /* helpers summed above but not in members[] (more than WS_SLOTS) */
    __u16 ws_refused;      /* wakes refused by the WS_MAX cap */
    __u8  ws_nslots;       /* members[] in use */
    __u8  ws_flags;        /* WSF_* */
    __u32 _pad2;
    struct ws_member members[WS_SLOTS];
    /* --- sent only with WSF_CUDA (then the record is sent whole, members[] included) --- */
    struct cuda_block cuda;
};

/* A record ends after its last used work-set member: members[ws_nslots..] are not sent (unless
 * WSF_CUDA: then all of it is). */
#define REC_HTTP_FIXED_SIZE __builtin_offsetof(struct http_record, members)

/* The overload budget's in-kernel sampling (agent/pipeline/budget.py writes `sampling`[0]). A
 * request is kept when its trace id's low 8 bytes, read big-endian, are below `bound`: the rule
 * of OpenTelemetry's TraceIdRatioBased sampler, so agents on every node keep the same traces. */
struct sampling {
    __u64 bound;           /* ratio x 2^64 */
    __u32 active;          /* 0: keep every request (ratio 1: nothing is decoded) */
    __u32 _pad;
};

/* What the kernel keeps of a request it did not send (the budget shed it): counts and latency
 * (start -> end, as the span would have had), per endpoint. */
#define AGG_BUCKETS 24        /* log2 latency buckets: [2^i, 2^(i+1)) µs; the last is open */
#define AGG_ENTRIES 1024      /* endpoints kept (LRU) */
#define AGG_SHED 1            /* agg_key.why: sampled out by the budget */
#define AGG_UNSAMPLED 2       /* ... a valid traceparent its caller did not sample (--unsampled follow) */
#define AGG_NO_PARENT 3       /* ... no traceparent header at all (--no-parent skip) */
struct agg_key {
    __u32 pid;             /* process that read the request */
    __u16 lport;           /* server port (0: the tuple was not known) */
    __u16 why;             /* AGG_* */
};
struct agg_val {
    __u64 count;
    __u64 sum_ns;
    __u64 hist[AGG_BUCKETS];
};

/* The span policies, written once at start (agent/kernel/probes.py): a request that will not
 * become a span under them is aggregated in the kernel instead of crossing the ring buffer. All
 * zero (the value before user space writes it): every request crosses, as without the map. */
struct policy {
    __u8  agg_unsampled;   /* --unsampled follow: no span for a valid unsampled traceparent */
    __u8  agg_no_parent;   /* --no-parent skip: no span for a request without traceparent */
    __u8  _pad[6];
};

/* Per-CPU counters in the `counters` array map, by index. User space exports CNT_FOO as
 * `kernel_foo` (the name is the macro's suffix, lowercased; tests/test_decode.py checks it). */
#define CNT_RECORDS_SUBMITTED    0 /* records the kernel tried to emit */
#define CNT_RINGBUF_FULL         1 /* ... of which the ring buffer had no room for */
#define CNT_PIPELINE_SLOTS_FULL  2 /* requests not tracked: too many pipelined on one connection */
#define CNT_NON_HTTP_CONNECTIONS 3 /* first reads on a connection that were not HTTP/1.x */
#define CNT_REQUEST_STATE_LOST   4 /* request state evicted from the LRU before its response */
#define CNT_READ_COPY_FAILED     5 /* read_user (bpf_probe_read_user) failed on a buffer to scan */
/* Connections whose framing the kernel stopped trusting, by reason (once per connection): no
 * request is opened on them any more; requests already open still take their responses. */
#define CNT_UNTRUSTED_CONTENT_LENGTH       6  /* request Content-Length malformed, duplicate or folded */
#define CNT_UNTRUSTED_TRANSFER_ENCODING    7  /* request Transfer-Encoding not ending in chunked */
#define CNT_UNTRUSTED_TE_AND_CL            8  /* request with both (framed by TE, nothing after it) */
#define CNT_UNTRUSTED_CHUNKED              9  /* chunked body syntax error (request or response) */
#define CNT_UNTRUSTED_HEADERS_TOO_LONG     10 /* request line + headers past HDR_LIMIT */
#define CNT_UNTRUSTED_REQUEST_LINE         11 /* where a request had to start, none did */
#define CNT_UNTRUSTED_RESPONSE_WITHOUT_REQUEST 12 /* more responses than requests */
#define CNT_UNTRUSTED_EARLY_RESPONSE       13 /* response before the request's headers ended */
#define CNT_UNTRUSTED_RESPONSE_INVALID     14 /* bad status line or response Content-Length */
#define CNT_UNTRUSTED_PIPELINE_OVERFLOW    15 /* more requests open than the kernel can frame */
#define CNT_UNTRUSTED_UNSCANNED            16 /* bytes to frame were not scanned (budget, copy) */
#define CNT_WORKSET_FULL        20 /* wakes refused: the work set already had WS_MAX threads */
#define CNT_WORKSET_LOST        21 /* work sets evicted (or never created) before the response */
#define CNT_WORKSET_REFS_FULL   22 /* threads in more than WS_REFS open work sets at once */
#define CNT_SAMPLED_OUT_BUDGET  23 /* requests the overload budget's ratio kept in the kernel
                                    * (aggregated in `shed`; not records, never a loss) */
#define CNT_UNSAMPLED_AGGREGATED 24 /* valid unsampled traceparent, --unsampled follow: no span;
                                     * aggregated in `shed` (AGG_UNSAMPLED), never sent */
#define CNT_NO_PARENT_AGGREGATED 25 /* no traceparent header, --no-parent skip: no span;
                                     * aggregated in `shed` (AGG_NO_PARENT), never sent */
/* HTTP/2 (bpf/http2_*.h) */
#define CNT_H2_CONNECTIONS      32 /* connections that became HTTP/2 (preface or Upgrade: h2c) */
#define CNT_H2_STREAMS_FULL     33 /* streams not tracked: their slot of H2_STREAMS was taken */
#define CNT_H2_FRAME_INVALID    34 /* connections whose framing was lost: an invalid frame */
#define CNT_H2_HPACK_INVALID    35 /* ... an HPACK block we could not decode */
#define CNT_H2_UNSCANNED        36 /* ... bytes not scanned (tail-call budget, copy failure) */
#define CNT_H2_PREFACE_BAD      37 /* "PRI *" not followed by the HTTP/2 client preface */
#define CNT_H2_DYN_UNRESOLVED   38 /* fields we need referring to a dynamic-table entry whose
                                    * value the kernel does not hold (evicted, or not copied) */
#define CNT_H2_DYN_BEYOND       39 /* ... to an entry older than the H2_KINDS insertions tracked */
#define CNT_H2_STATE_LOST       40 /* stream or connection state evicted before the stream ended */
#define CNT_H2_HEADERS_CUT      41 /* streams that ended before their header block did: not emitted */
#define CNT_H2_UNANSWERED       42 /* streams not emitted: the server never spoke HTTP/2 (no SETTINGS) */
#define CNT_H2_MALFORMED        43 /* streams not emitted: their request had no :method or no :path */
#define CNT_H2_FIELD_UNRESOLVED 44 /* streams not emitted: a field was unresolved (38, 39) and the
                                    * traceparent, :method or :path it may have been is missing */
#define CNT_H2_NOT_LOADED       45 /* connections that turned HTTP/2 while its programs were not
                                    * loaded (the seconds after ready, or a failed load): ignored */
#define CNT_CUDA_UNATTRIBUTED   46 /* probed CUDA calls by a thread in no open work set */
#define CNT_CUDA_NESTED         47 /* probed calls beneath another (runtime over driver): not
                                    * counted again */
#define CNT_CUDA_ACC_LOST       48 /* CUDA sums of a work set that could not be created */
#define CNT_OTLP_CONNECTS       49 /* TCP connections this host opened to a port in otlp_ports:
                                    * when the inspector looks at TCP tables again */
#define CNT_MAX                  64 /* size of the map: indices in use are below it */

#endif
