/* tracejoin: HTTP/1.x requests served on this host, with their traceparent and what the kernel
 * did to each, one fixed-size record per finished request.
 *
 * One compile unit: this file holds the shared state (connection, scratch and thread structs,
 * every map more than one include uses; the work set's own maps are in http_workset.h) and
 * includes the programs by concern, in dependency order:
 *   http_record.h    the C <-> Python contract (record layout, flags, counters, prog indices)
 *   http_workset.h   the work set: the threads that worked for a request (sched_waking)
 *   http_enrich.h    per-thread / per-connection enrichment: sched, faults, TLB, TCP
 *   http_conn.h      connection lifecycle: syscall buffers, TCP states, socket data, flush
 *   http_scan.h      helpers shared by the two scanners
 *   http_request.h   request scanner (tail call)
 *   http_response.h  response scanner (tail call); emits the record
 * `tracejoin ebpf` prints the unit as compiled: includes inlined, defines applied.
 *
 * Only tracepoints and perf events (no kprobes, no struct dereferences): every value comes from
 * a tracepoint argument whose layout BCC reads from tracefs at load time, so kernel headers that
 * do not match the running kernel cannot skew it.
 *
 * Flow per connection (keyed by the socket pointer the sock: tracepoints hand us):
 *   inet_sock_set_state SYN_RECV->ESTABLISHED  create conn state with its 4-tuple
 *   sk_data_ready                               first arrival since the last read
 *   sys_enter_{read,readv,recvfrom,recvmsg}     remember the user buffer (per thread)
 *   sock_recv_length                            the buffer now holds `ret` bytes: scan them
 *   sys_enter_{write,writev,sendto,sendmsg,sendfile64} / sock_send_length: same for responses
 *   inet_sock_set_state (we close) / tcp_destroy_sock: flush what is still open
 * Scanning runs in tail-called programs (scan_req, scan_resp) of SCAN_CHUNK bytes each, so the
 * verifier sees small bounded loops.
 *
 * Defines set by agent/kernel/probes.py (integers or present/absent; no user text is ever
 * pasted in here):
 *   WITH_RECVQ, WITH_TUPLE_AT_READ, WITH_TCPSTATS, WITH_SCHED, WITH_TLB_FLUSH, WITH_FAULTS,
 *   WITH_WORKSET (needs WITH_SCHED)
 *   TASK_FLAGS_OFF, TASK_PID_OFF, TASK_TGID_OFF, TASK_COMM_OFF
 *                                          task_struct member offsets from the running kernel's
 *                                          BTF (WITH_WORKSET only; agent/kernel/btf.py)
 *   AGENT_TGID, WITH_IRQ_VECTORS           the agent's own process; x86 irq_work tracepoints
 *                                          exist (WITH_WORKSET only)
 *                                          optional signals whose tracepoints/events exist
 *   FILTER_PID, FILTER_PORT, FILTER_COMM   filters are active (values live in maps)
 *   TLB_HW                                 hardware dTLB/iTLB counters are open
 *   RUNQ_THRESHOLD_NS                      run-queue waits at least this long are kept as intervals
 *   NCPU                                   possible CPUs
 */
#include <uapi/linux/ptrace.h>
#include <linux/socket.h>
#include <linux/uio.h>
#include "http_record.h"

#ifndef RUNQ_THRESHOLD_NS
#define RUNQ_THRESHOLD_NS 1000000
#endif
#ifndef NCPU
#define NCPU 64
#endif

#define AF_INET_ 2
#define AF_INET6_ 10
#define IPPROTO_TCP_ 6
#define MSG_PEEK_ 2
#define TCP_ESTABLISHED_ 1
#define TCP_SYN_SENT_ 2
#define TCP_SYN_RECV_ 3
#define TCP_FIN_WAIT1_ 4
#define TCP_CLOSE_ 7
#define TCP_LAST_ACK_ 9

#define SCRATCH_SIZE 4096       /* bytes of one read/write copied for scanning (power of two) */
#define SCAN_CHUNK 256          /* bytes scanned per program before tail-calling the next */
#define CL_MAX (1ULL << 40)
#define PREFIX_MAX 16           /* carried request-line bytes: a method, a space, a '/' */

/* conn.flags */
#define CONN_IGNORED 0x01       /* filtered out, a client-side socket, or not HTTP */
#define CONN_TUPLE 0x02
#define CONN_SEEN_REQ 0x04

/* request parser states */
enum { RQ_NONE, RQ_PATH, RQ_LINE_REST, RQ_LINE_START, RQ_SKIP_LINE, RQ_CR, RQ_TP_OWS, RQ_TP_VALUE,
       RQ_CL_VALUE, RQ_BODY, RQ_UNFRAMED, RQ_OVERFLOW };
/* response parser states */
enum { RS_STATUS, RS_LINE_REST, RS_LINE_START, RS_SKIP_LINE, RS_CR, RS_CL_VALUE, RS_BODY,
       RS_CHUNKED, RS_OPAQUE };

struct conn {
    u64 conn_id;
    u64 est_ns;
    u64 arrival_ns;
    u64 head;                   /* oldest request still waiting for its response to end */
    u64 tail;                   /* next request number */
    u64 last_write_ns;
    u64 rq_cl;                  /* request Content-Length being parsed */
    u64 rq_body;                /* request body bytes still to skip */
    u64 rs_cl;
    u64 rs_body;
    u32 retrans;
    u32 srtt_us;
    u32 unacked_max;            /* most bytes in flight unacknowledged since the response began */
    u32 rq_scanned;             /* header bytes scanned for the request being parsed */
    u16 rq_tpraw;               /* traceparent value bytes seen, OWS included */
    u16 rs_status;
    u16 lport, rport;
    u8 laddr[16], raddr[16];
    u8 family;
    u8 flags;
    u8 rq_state;
    u8 rs_state;
    u8 rs_chunked;
    u8 rs_tail[5];              /* last bytes written while chunked: the terminator check */
    u8 rq_plen;                 /* bytes of a request line carried over from earlier reads */
    u8 rq_prefix[PREFIX_MAX];   /* (Go's net/http reads one byte ahead, for one) */
};

struct req_key {
    u64 sk;
    u64 seq;
};

struct pending_io {
    u64 buf;                    /* user buffer (first iovec for the vectored calls) */
    u64 len;                    /* its length */
    u32 fd;
    u32 has_buf;
};

struct scratch {
    u8 buf[SCRATCH_SIZE];
    u64 sk;
    u64 now;
    u32 n;                      /* bytes copied into buf */
    u32 total;                  /* bytes the syscall moved */
    u32 off;                    /* next byte to scan */
    u32 fd;
    u32 chain;                  /* tail calls used so far */
};

/* An open request's work set, as a thread refers to it: the request's key in `worksets`
 * (conn_id is never 0 for a live reference) and the thread's index among its members. */
struct ws_ref {
    u64 conn_id;
    u64 seq;
    u32 idx;                    /* 0: this thread read the request */
    u32 _pad;
};

/* Per-thread running totals. A request takes differences of them over the time a thread
 * worked for it (bpf/http_workset.h), so no per-event work ever touches a request. */
struct tstat {
    u64 tot[WSIG_COUNT];        /* by WSIG_* */
    u64 sh[WSIG_COUNT];         /* ... the part counted while nopen > 1 */
    u64 appt;                   /* on-CPU while nopen > 1, each slice divided by nopen */
    u64 runq_max;
    u64 queued_ts, wake_ts, sleep_ts;
    u64 oncpu_ts;               /* switched in at; 0 while off CPU */
    u64 hw_d_in, hw_i_in;       /* counter values at switch-in (TLB_HW) */
    u32 ring_idx;
    u32 nopen;                  /* open requests whose work set holds this thread */
    u32 asleep;                 /* switched out blocked, not woken since */
    u32 tgid;                   /* its process, as last seen running; 0 before */
    u32 reading;                /* open requests this thread read (it is their member 0) */
    u32 _pad;
    struct ws_ref refs[WS_REFS];
    struct runq_wait ring[RUNQ_SLOTS];
};

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(counters, u64, CNT_MAX);
BPF_PERCPU_ARRAY(scratch_map, struct scratch, 1);
BPF_PERCPU_ARRAY(zero_rec, struct http_record, 1);      /* never written: a zeroed template */
BPF_PERCPU_ARRAY(conn_seq, u64, 1);
BPF_TABLE("lru_hash", u64, struct conn, conns, LRU_ENTRIES);
BPF_TABLE("lru_hash", struct req_key, struct http_record, reqs, LRU_ENTRIES);
BPF_TABLE("lru_hash", u64, struct pending_io, pending_rd, LRU_ENTRIES);
BPF_TABLE("lru_hash", u64, struct pending_io, pending_wr, LRU_ENTRIES);
BPF_TABLE("lru_hash", u32, struct tstat, threads, LRU_ENTRIES);
BPF_PERCPU_ARRAY(zero_thread, struct tstat, 1);         /* never written: a zeroed template */
BPF_PROG_ARRAY(progs, PROG_COUNT);
BPF_HASH(filter_pid, u32, u8, 1024);
BPF_HASH(filter_port, u16, u8, 1024);
struct comm_t {
    char c[16];
};
BPF_ARRAY(filter_comm, struct comm_t, 1);
#ifdef TLB_HW
BPF_PERF_ARRAY(dtlb, NCPU);
BPF_PERF_ARRAY(itlb, NCPU);
#endif

static __always_inline void count(u32 idx)
{
    u64 *v = counters.lookup(&idx);
    if (v)
        (*v)++;
}

static __always_inline int comm_allowed(void)
{
#ifdef FILTER_COMM
    char comm[16] = {};
    int z = 0;
    bpf_get_current_comm(&comm, sizeof(comm));
    struct comm_t *want = filter_comm.lookup(&z);
    if (!want)
        return 0;
#pragma unroll
    for (int i = 0; i < 16; i++) {
        if (comm[i] != want->c[i])
            return 0;
        if (comm[i] == 0)
            break;
    }
#endif
    return 1;
}

static __always_inline int task_allowed(u32 pid)
{
#ifdef FILTER_PID
    if (!filter_pid.lookup(&pid))
        return 0;
#endif
    return comm_allowed();
}

#include "http_workset.h"
#include "http_enrich.h"
#include "http_conn.h"
#include "http_scan.h"
#include "http_request.h"
#include "http_response.h"
