/* tracejoin: HTTP/1.x requests served on this host, with their traceparent and what the kernel
 * did to each, one fixed-size record per finished request.
 *
 * One compile unit: this file holds the shared state (connection, scratch and thread structs,
 * every map more than one include uses; the work set's own maps are in http_workset.h) and
 * includes the programs by concern, in dependency order:
 *   http_record.h    the C <-> Python contract (record layout, flags, counters, prog indices)
 *   http_workset.h   the work set: the threads that worked for a request (sched_waking)
 *   http_enrich.h    per-thread / per-connection enrichment: sched, faults, TLB, TCP
 *   http_scan.h      what both scanners share: the scan window, header/body framing
 *   http_conn.h      connection lifecycle: syscall exits, TCP states, socket data, flush
 *   http_request.h   request scanner (tail call)
 *   http_response.h  response scanner (tail call); emits the record
 *   http2_conn.h     HTTP/2 (h2c) connection state and the hand-off from the HTTP/1.x path
 *   http2_scan.h     HTTP/2 frames and HPACK (tail calls); one record per stream
 * `tracejoin ebpf` prints the unit as compiled: includes inlined, defines applied.
 *
 * Only tracepoints and perf events (no kprobes, no kernel struct dereferences): every value
 * comes from a tracepoint argument whose layout BCC reads from tracefs at load time, so kernel
 * headers that do not match the running kernel cannot skew it. Two exceptions, each read at
 * offsets that cannot drift: a syscall's arguments, from the thread's saved user registers
 * (their layout is the user ABI: syscall_args), and the work set's task_struct fields, at
 * offsets taken from the running kernel's BTF.
 *
 * Flow per connection (keyed by the socket pointer the sock: tracepoints hand us):
 *   inet_sock_set_state SYN_RECV->ESTABLISHED  create conn state with its 4-tuple
 *   sk_data_ready                               first arrival since the last read
 *   sock_recv_length                            the read's buffer (its syscall's arguments,
 *                                               syscall_io) now holds `ret` bytes: scan them
 *   sock_send_length                            same for responses
 *   sys_exit_{read,...,sendfile64}              run what the scan left for the syscall's end
 *   inet_sock_set_state (we close) / tcp_destroy_sock: flush what is still open
 * Scanning runs in tail-called programs (scan_req, scan_resp) of SCAN_CHUNK steps each, taken
 * LOOP_STEPS at a time by a bpf_loop callback (scan_req_steps, scan_resp_steps): the verifier
 * walks one callback, LOOP_STEPS steps deep, not every step of the chunk.
 *
 * Defines set by agent/kernel/probes.py (integers or present/absent; no user text is ever
 * pasted in here):
 *   WITH_RECVQ, WITH_TUPLE_AT_READ, WITH_TCPSTATS, WITH_SCHED, WITH_TLB_FLUSH, WITH_FAULTS,
 *   WITH_WORKSET (needs WITH_SCHED)
 *   WITH_CUDA (needs WITH_WORKSET), CUDA_SYNC_THRESHOLD_NS
 *                                          uprobes on CUDA calls (bpf/cuda.h), attached by
 *                                          agent/kernel/cuda.py to the libraries it finds
 *   TASK_FLAGS_OFF, TASK_PID_OFF, TASK_TGID_OFF, TASK_COMM_OFF
 *                                          task_struct member offsets from the running kernel's
 *                                          BTF (WITH_WORKSET only; agent/kernel/btf.py)
 *   WITH_IRQ_VECTORS                       x86 irq_work tracepoints
 *                                          exist (WITH_WORKSET only)
 *                                          optional signals whose tracepoints/events exist
 *   FILTER_PID, FILTER_PORT, FILTER_COMM   filters are active (values live in maps)
 *   TLB_HW                                 hardware dTLB/iTLB counters are open
 *   RUNQ_THRESHOLD_NS                      run-queue waits at least this long are kept as intervals
 *   WAKE_EVERY                             records per CPU between forced reader wake-ups (a
 *                                          power of two: NCPU x WAKE_EVERY <= half the ring)
 *   NCPU                                   possible CPUs
 *   ARCH_X86_64, ARCH_ARM64                whose syscall ABI syscall_args reads
 * and by agent/kernel/compiled.py (loop_callback_defines):
 *   LOOP_CB_MARK, LOOP_CB_<function>       the markers by which a bpf_loop call names its callback
 */
/* uapi headers only: the kernel's own (linux/socket.h, linux/uio.h) pull in enough of the
 * kernel to add ~0.25 s to every compile (bench.compile_units) for two small ABI structs. */
#include <uapi/linux/ptrace.h>
#include <uapi/linux/uio.h>
#include "http_record.h"

/* bpf_probe_read_user under a name of our own: BCC's rewriter answers each call by that name by
 * loading every kernel symbol from /proc/kallsyms, to check that the helper exists (~0.1-0.2 s
 * of each compile). Every kernel this agent runs on has it (5.8+, for the ring buffer). */
static long (*read_user)(void *dst, u32 size, const void *src) = (void *)BPF_FUNC_probe_read_user;

#ifndef RUNQ_THRESHOLD_NS
#define RUNQ_THRESHOLD_NS 1000000
#endif
#ifndef NCPU
#define NCPU 64
#endif
#ifndef WAKE_EVERY
#define WAKE_EVERY 1
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

#define SCRATCH_SIZE 4096       /* bytes of a read/write copied per window (power of two) */
#define SCAN_CHUNK 256          /* scanner steps per program before tail-calling the next */
#define LOOP_STEPS 8            /* scanner steps per bpf_loop callback (SCAN_CHUNK / LOOP_STEPS calls) */
#define CHAIN_MAX 30            /* tail calls one read/write may use (the kernel allows 33) */
#define IOV_WALK 16             /* iovecs looked at per window load */
#define CL_MAX (1ULL << 40)     /* a larger Content-Length or chunk size is invalid */
#define HDR_LIMIT 32768         /* request line + header bytes scanned before giving up */
#define NAME_BUF 24             /* header-name bytes kept (the longest we match is 17) */
#define OUTSTANDING_MAX 64      /* requests open on one connection, tracked or not (bit maps) */

/* conn.flags */
#define CONN_IGNORED 0x01       /* filtered out, a client-side socket, or not HTTP */
#define CONN_TUPLE 0x02
#define CONN_SEEN_REQ 0x04
#define CONN_UNTRUSTED 0x08     /* framing disagreement: no request is opened any more */
#define CONN_RESP_LOST 0x10     /* response framing lost: writes are no longer scanned */
#define CONN_H2 0x20            /* HTTP/2: framed by bpf/http2_scan.h, per stream */
#define CONN_H2_NEW 0x40        /* ... by a 101 just written: its state is not made yet */

/* Parser states, shared by both directions (struct hparse.state). */
enum {
    /* start line */
    P_IDLE,         /* request: between requests (the next byte starts a method) */
    P_METHOD,       /* request: method token */
    P_TARGET,       /* request: first byte of the request-target */
    P_ABS_SCHEME,   /* request: absolute-form scheme, up to ':' */
    P_ABS_SLASH,    /* request: the "//" after it */
    P_ABS_AUTH,     /* request: authority (userinfo, host, port): skipped, never copied */
    P_PATH,         /* request: path bytes, copied */
    P_PARAM,        /* request: a ";param" path segment parameter, skipped */
    P_STATUS,       /* response: "HTTP/1.x NNN" */
    P_LINE_REST,    /* the rest of the start line */
    /* header section */
    P_LINE_START, P_NAME, P_CR, P_SKIP_LINE, P_TP_OWS, P_TP_VALUE, P_CL_VALUE, P_TE_VALUE,
    /* body */
    P_BODY, P_CHUNK_SIZE, P_CHUNK_EXT, P_CHUNK_END, P_CHUNK_DATA, P_TRAILER, P_TRAILER_SKIP,
    P_OPAQUE,       /* response: close-delimited, or framing lost: ends with the connection */
    P_DEAD,         /* request: the connection is no longer trusted */
};

/* hparse.fr: framing headers seen in the message being parsed */
#define FR_CL 0x01              /* a valid Content-Length */
#define FR_CL_BAD 0x02          /* malformed, duplicate or folded Content-Length */
#define FR_TE 0x04              /* Transfer-Encoding present */
#define FR_TE_CHUNKED 0x08      /* ... and its final coding is chunked */
#define FR_TE_BAD 0x10          /* ... folded or unparseable */
/* hparse.hdr: the header whose line is being read */
enum { H_OTHER, H_TP, H_CL, H_TE };

/* One direction's message parser (struct conn holds one for requests, one for responses). */
struct hparse {
    u64 len;                    /* Content-Length, then body or chunk bytes still to skip */
    u8 state;                   /* P_* */
    u8 fr;                      /* FR_* */
    u8 hdr;                     /* H_* */
    u8 sub;                     /* position inside the token being read */
    u8 nlen;                    /* header-name bytes kept in name[] */
    u8 _pad[3];
    u8 name[NAME_BUF];          /* lowercased header name; the raw method, for requests */
};

struct conn {
    u64 conn_id;
    u64 est_ns;
    u64 arrival_ns;             /* first arrival since the last read (sk_data_ready) */
    u64 rq_start_ns;            /* read that brought the first byte of the request line */
    u64 rq_arrival_ns;          /* ... and that byte's arrival */
    u64 head;                   /* oldest request still waiting for its response to end */
    u64 tail;                   /* next request number */
    u64 last_write_ns;
    u64 head_bits;              /* bit (seq & 63): the request is HEAD (its response has no body) */
    u64 connect_bits;           /* ... CONNECT (a 2xx turns the connection into a tunnel) */
    u64 ghost_bits;             /* ... not tracked (pipeline slots full): framed, not emitted */
    struct hparse rq, rs;
    u32 retrans;
    u32 srtt_us;
    u32 unacked_max;            /* most bytes in flight unacknowledged since the response began */
    u32 rq_scanned;             /* request line + header bytes of the request being parsed */
    u16 rq_tpraw;               /* traceparent value bytes seen, OWS included */
    u16 rs_status;
    u16 lport, rport;
    u8 laddr[16], raddr[16];
    u8 family;
    u8 flags;                   /* CONN_* */
    u8 slot_of[MAX_PENDING];    /* by seq % MAX_PENDING: an open tracked request's slot (h1_slot) */
    u8 slots_busy;              /* bit per slot: held by an open request */
    u8 slots_used;              /* bit per slot: ever held (tcp_destroy_sock deletes them) */
};

struct req_key {
    u64 sk;
    u64 seq;
};

/* What the thread's read or write moves, read from its syscall's arguments (syscall_io). */
#define IO_NONE 0               /* no user buffer (sendfile): bytes counted, not scanned */
#define IO_BUF 1                /* one buffer */
#define IO_IOV 2                /* an iovec array (readv, writev, recvmsg, sendmsg) */
struct syscall_io {
    u64 ptr;                    /* IO_BUF: the buffer; IO_IOV: the iovec array */
    u64 len;                    /* IO_BUF: its length; IO_IOV: the number of iovecs */
    u32 fd;
    u32 kind;                   /* IO_* */
};

/* One read or write being scanned: a window of SCRATCH_SIZE bytes of it at a time. */
/* A request's opening or ending that a scanner leaves for the syscall's exit (syscall_exit() in
 * http_conn.h, bpf/http_workset.h): the scanners are near the verifier's limit, so they only
 * note it, in a few stores and no branch. */
#define WS_NOTES 4
#define WS_NOTE_OPEN 1
#define WS_NOTE_CLOSE 2
struct ws_note {
    u64 sk;
    u64 seq;                    /* OPEN: the record's key in `reqs` (req_map_seq); CLOSE: the
                                 * request's seq (its work set's key) */
    u64 conn_id;
    u64 arg;                    /* OPEN: the request's own seq (the entry may hold a later
                                 * request of the connection by then); CLOSE: its end, in ns */
    u32 tid;                    /* the thread whose syscall exit runs it */
    u32 kind;                   /* WS_NOTE_*; 0: empty */
};

struct scratch {
    u8 buf[2 * SCRATCH_SIZE];   /* bytes [base, base + n) of the data; n <= SCRATCH_SIZE */
    u64 sk;
    u64 now;
    u64 arrival;                /* first arrival of this read's data (requests); 0 unknown */
    u64 ptr, len;               /* syscall_io.ptr/len */
    u64 iov_start;              /* data offset of iovec iov_idx's first byte */
    u32 iov_idx;
    u32 kind;                   /* IO_* */
    u32 base;
    u32 n;
    u32 total;                  /* bytes the syscall moved */
    u32 off;                    /* next byte to scan */
    u32 fd;
    u32 chain;                  /* tail calls used so far */
    u32 walk_more;              /* the iovec walk stopped short: load again to go on */
    u32 h2_more;                /* 1 + PROG_H2_*: an HTTP/2 scan out of tail calls goes on at
                                 * the syscall's exit (syscall_exit()); H2_MORE_EXIT: that pass runs */
    struct ws_note notes[WS_NOTES];
    u32 nnotes;                 /* notes written so far (the last WS_NOTES are kept) */
    u32 h2_tid;                 /* the thread whose exit h2_more waits for */
    s32 step;                   /* STEP_*: what the last steps of a bpf_loop returned (both
                                 * directions' scanners, HTTP/2's decoder). Here, not in the
                                 * caller's stack struct: a result written there costs the
                                 * verifier 2-4x the instructions (bench.verifier_cost) */
};

/* A bpf_loop callback, named by a marker the loader links (agent/kernel/compiled.py): BCC keeps
 * every function in a section of its own and links no call between them. It takes bpf_loop's
 * (index, ctx) as one 16-byte struct, which clang passes in r1 and r2 as bpf_loop does: BCC
 * rewrites a function's second parameter into a pt_regs read. ctx points to the caller's stack,
 * where the caller leaves the pointers the callback works with (the verifier keeps their
 * types), so a call costs no map lookup. */
#define LOOP_CB(fn) ((void *)((LOOP_CB_MARK << 32) | LOOP_CB_##fn))
struct loop_arg {
    u64 index;
    void *ctx;
};

/* An open request's work set, as a thread refers to it: the request's key in `worksets`
 * (conn_id is never 0 for a live reference) and the thread's index among its members. */
struct ws_ref {
    u64 conn_id;
    u64 seq;
    u32 idx;                    /* 0: this thread read the request; | REF_REPLIED: it left by
                                 * waking the reader, and rejoins if it hands the work on */
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
    u64 hw_d_in, hw_i_in;       /* counter values when the thread last went on CPU (TLB_HW) */
    u32 ring_idx;
    u32 nopen;                  /* open requests whose work set holds this thread */
    u32 asleep;                 /* switched out blocked, not woken since */
    u32 tgid;                   /* its process, as last seen running; 0 before */
    u32 reading;                /* open requests this thread read (it is their member 0) */
    u32 nreplied;               /* refs[] it keeps to sets it replied to (REF_REPLIED) */
    struct ws_ref refs[WS_REFS];
    struct runq_wait ring[RUNQ_SLOTS];
};

BPF_RINGBUF_OUTPUT(events, RINGBUF_PAGES);
BPF_PERCPU_ARRAY(counters, u64, CNT_MAX);
BPF_PERCPU_ARRAY(scratch_map, struct scratch, 1);
BPF_PERCPU_ARRAY(zero_rec, struct http_record, 1);      /* never written: a zeroed template */
BPF_PERCPU_ARRAY(conn_seq, u64, 1);
BPF_PERCPU_ARRAY(conn_new, struct conn, 1);     /* a connection's state being made, then copied */
BPF_TABLE("lru_hash", u64, struct conn, conns, LRU_ENTRIES);
BPF_TABLE("lru_hash", struct req_key, struct http_record, reqs, LRU_ENTRIES);
BPF_TABLE("lru_hash", u32, struct tstat, threads, LRU_ENTRIES);
BPF_PERCPU_ARRAY(zero_thread, struct tstat, 1);         /* never written: a zeroed template */
BPF_PROG_ARRAY(progs, PROG_COUNT);
BPF_ARRAY(sampling, struct sampling, 1);
BPF_ARRAY(policy, struct policy, 1);
BPF_TABLE("lru_percpu_hash", struct agg_key, struct agg_val, shed, AGG_ENTRIES);
BPF_HASH(filter_pid, u32, u8, 1024);
BPF_HASH(filter_port, u16, u8, 1024);
BPF_HASH(otlp_ports, u16, u8, 64);  /* --otlp-ports: connections to them are counted (inspector) */
struct comm_t {
    char c[16];
};
BPF_ARRAY(filter_comm, struct comm_t, 1);
#ifdef TLB_HW
BPF_PERF_ARRAY(dtlb, NCPU);
BPF_PERF_ARRAY(itlb, NCPU);
#endif

/* An HTTP/1.x request's record is kept in `reqs` under a slot of its connection, not its
 * sequence number: the lowest slot no open request of the connection holds. A keep-alive
 * connection's next request takes the slot its predecessor left and writes over its entry, so
 * the common request costs no LRU insert and no delete (those were ~3 % of the server's CPU at
 * saturation, bench.kernel_profile), and a connection holds one entry however many requests
 * it serves (more only while it has several pipelined requests open). The entry says whose it
 * is (conn_id, seq; conn_id 0 once it was sent), and h1_record checks both: the entry may
 * hold an earlier request of the connection, or one of an earlier connection at the same
 * socket address. Slots' keys have the top bit set; HTTP/2 streams' (their stream ids, below
 * 2^31) do not. tcp_destroy_sock deletes the slots a connection used. */
#define H1_SLOT_KEY (1ULL << 63)
_Static_assert(MAX_PENDING == 8, "a slot is 3 bits (slot_of, slots_busy)");

static __always_inline u64 h1_key_seq(u32 slot)
{
    return H1_SLOT_KEY | (slot & (MAX_PENDING - 1));
}

/* The seq a record is kept under in `reqs`: its stream id, or its slot's. */
static __always_inline u64 req_map_seq(struct http_record *rec)
{
    return (rec->h2_flags & H2F_STREAM) ? rec->seq : h1_key_seq(rec->h1_slot);
}

/* HTTP/1.x request `seq` of connection c (open and tracked): its record, or 0 when it is not
 * in `reqs` (evicted). */
static __always_inline struct http_record *h1_record(u64 sk, struct conn *c, u64 seq)
{
    struct req_key key = {.sk = sk, .seq = h1_key_seq(c->slot_of[seq & (MAX_PENDING - 1)])};
    struct http_record *rec = reqs.lookup(&key);
    if (rec && rec->conn_id == c->conn_id && rec->seq == seq)
        return rec;
    return 0;
}

/* A record for new HTTP/1.x request `seq`, in the lowest free slot: that slot's entry, its
 * fixed part written over with the zeroed template, or a new entry. 0 when the map refused
 * it. members[] and cuda are left as they are: they are only ever sent after ws_snapshot and
 * cuda_snapshot copied them whole (record_size sends members[] by ws_nslots, in the fixed
 * part, and cuda by WSF_CUDA), so the template's copy is half a record, not all of it. The
 * caller opens at most MAX_PENDING at once, so a slot is free. */
static __always_inline struct http_record *h1_new_record(u64 sk, struct conn *c, u64 seq,
                                                         struct http_record *tmpl)
{
    u32 slot = 0;
#pragma unroll
    for (int i = MAX_PENDING - 1; i >= 0; i--)
        if (!(c->slots_busy & (1 << i)))
            slot = i;
    struct req_key key = {.sk = sk, .seq = h1_key_seq(slot)};
    struct http_record *rec = reqs.lookup(&key);
    if (rec) {
        bpf_probe_read_kernel(rec, REC_HTTP_FIXED_SIZE, tmpl);    /* one call, not 68 stores */
    } else {
        if (reqs.update(&key, tmpl) != 0)
            return 0;
        rec = reqs.lookup(&key);
        if (!rec)
            return 0;
    }
    rec->h1_slot = slot;
    c->slot_of[seq & (MAX_PENDING - 1)] = slot;
    c->slots_busy |= 1 << slot;
    c->slots_used |= 1 << slot;
    return rec;
}

/* Open request `seq` no longer holds its slot (it ended, or its entry was found evicted). */
static __always_inline void h1_release(struct conn *c, u64 seq)
{
    c->slots_busy &= ~(1 << (c->slot_of[seq & (MAX_PENDING - 1)] & (MAX_PENDING - 1)));
}

#define DIR_RD 0
#define DIR_WR 1

static __always_inline void count(u32 idx)
{
    u64 *v = counters.lookup(&idx);
    if (v)
        (*v)++;
}

/* Stop trusting the connection's framing: count why (once per connection) and never open
 * another request on it. Requests already open still take their responses. */
static __always_inline void untrust(struct conn *c, u32 reason)
{
    if (!(c->flags & CONN_UNTRUSTED))
        count(reason);
    c->flags |= CONN_UNTRUSTED;
    c->rq.state = P_DEAD;
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

/* ---------------------------------------------------------------- the syscall in progress */

/* Which read or write the current thread is in, and its buffer, come from the syscall's own
 * arguments in the thread's saved user registers (bpf_task_pt_regs), read only when a socket
 * event needs them. Nothing is attached to the syscalls' entries: every read and write on the
 * host, socket or not, would pay for a program there (bench/run.py's unrelated process).
 * The registers' layout is the user ABI (x86_64: ptrace's user_regs_struct; arm64: its
 * user_pt_regs, then orig_x0 and syscallno) and the numbers are the syscall ABI: neither moves
 * with the kernel. tests/test_btf.py checks the offsets against the running kernel's BTF. */
struct sc_args {
    u64 nr, fd, ptr, len;       /* the syscall number and its first three arguments */
};

#if !defined(ARCH_X86_64) && !defined(ARCH_ARM64)
#error "tracejoin reads syscall arguments from the saved user registers of x86_64 and arm64 only"
#endif
#ifdef ARCH_X86_64
#define NR_READ 0
#define NR_WRITE 1
#define NR_READV 19
#define NR_WRITEV 20
#define NR_SENDFILE 40
#define NR_SENDTO 44
#define NR_RECVFROM 45
#define NR_SENDMSG 46
#define NR_RECVMSG 47
#define PT_REGS_DX_AT 96        /* struct pt_regs: dx, si, di, orig_ax, ip, cs from here */
#endif
#ifdef ARCH_ARM64
#define NR_READ 63
#define NR_WRITE 64
#define NR_READV 65
#define NR_WRITEV 66
#define NR_SENDFILE 71
#define NR_SENDTO 206
#define NR_RECVFROM 207
#define NR_SENDMSG 211
#define NR_RECVMSG 212
#define PT_REGS_X1_AT 8         /* struct pt_regs: regs[1], regs[2] */
#define PT_REGS_PSTATE_AT 264   /* struct pt_regs: pstate, orig_x0, syscallno */
#endif

/* The u32 of kernel memory at addr: a field at an offset the kernel's BTF gave (a task's pid,
 * a socket's RTT); 0 when it cannot be read. */
static __always_inline u32 kernel_u32(u64 addr)
{
    u32 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (void *)addr);
    return v;
}

/* The current thread's syscall and arguments, as it made them from user space: 0 for a
 * kernel or io_uring worker thread (their registers are zeroed) and for a 32-bit syscall,
 * whose numbers differ. */
static __always_inline int syscall_args(struct sc_args *a)
{
    u64 regs = (u64)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
#ifdef ARCH_X86_64
    struct {
        u64 dx, si, di, orig_ax, ip, cs;
    } r;
    if (bpf_probe_read_kernel(&r, sizeof(r), (void *)(regs + PT_REGS_DX_AT)) != 0)
        return 0;
    a->nr = r.orig_ax;
    a->fd = r.di;
    a->ptr = r.si;
    a->len = r.dx;
    /* __USER_CS: 64-bit user mode (0x23 is 32-bit, 0 a worker). The selector is the low 16
     * bits: with FRED the word above it holds event flags (struct fred_cs). */
    return (u16)r.cs == 0x33;
#endif
#ifdef ARCH_ARM64
    u64 x[2];
    struct {
        u64 pstate, orig_x0;
        s32 syscallno;
        u32 _pad;
    } r;
    if (bpf_probe_read_kernel(&x, sizeof(x), (void *)(regs + PT_REGS_X1_AT)) != 0 ||
        bpf_probe_read_kernel(&r, sizeof(r), (void *)(regs + PT_REGS_PSTATE_AT)) != 0)
        return 0;
    a->nr = (u64)r.syscallno;
    a->fd = r.orig_x0;          /* regs[0] becomes the return value */
    a->ptr = x[0];
    a->len = x[1];
    return (r.pstate & 0x1f) == 0;      /* EL0t in AArch64 state (PSR_MODE32_BIT clear) */
#endif
}

/* DIR_RD or DIR_WR for the syscalls whose buffers the scanners read; -1 for any other (an
 * io_uring submission, recvmmsg, splice: their bytes are not scanned). */
static __always_inline int syscall_dir(u64 nr)
{
    switch (nr) {
    case NR_READ:
    case NR_RECVFROM:
    case NR_READV:
    case NR_RECVMSG:
        return DIR_RD;
    case NR_WRITE:
    case NR_SENDTO:
    case NR_WRITEV:
    case NR_SENDMSG:
    case NR_SENDFILE:
        return DIR_WR;
    }
    return -1;
}

/* The head of the message header recvmsg/sendmsg take from user space (the kernel's struct
 * user_msghdr, in linux/socket.h: the ABI's struct msghdr), as far as its iovec array. */
struct msghdr_head {
    void *msg_name;
    int msg_namelen;
    struct iovec *msg_iov;
    __kernel_size_t msg_iovlen;
};

/* The read or write the current thread is in: its direction, with what it moves in *io; -1
 * when it is in none the scanners read, or the pid/comm filters leave the thread out. */
static __always_inline int syscall_io(struct syscall_io *io)
{
    struct sc_args a = {};
    if (!syscall_args(&a))
        return -1;
    int dir = syscall_dir(a.nr);
    if (dir < 0 || !task_allowed(bpf_get_current_pid_tgid() >> 32))
        return -1;
    io->fd = a.fd;
    io->ptr = a.ptr;
    io->len = a.len;
    io->kind = IO_BUF;
    if (a.nr == NR_READV || a.nr == NR_WRITEV) {
        io->kind = IO_IOV;
    } else if (a.nr == NR_RECVMSG || a.nr == NR_SENDMSG) {
        struct msghdr_head m = {};
        if (read_user(&m, sizeof(m), (void *)a.ptr) != 0)
            goto no_buffer;
        io->kind = IO_IOV;
        io->ptr = (u64)m.msg_iov;
        io->len = m.msg_iovlen;
    } else if (a.nr == NR_SENDFILE) {
        goto no_buffer;         /* the body never passes through user memory */
    }
    return dir;
no_buffer:                      /* bytes counted, not scanned */
    io->kind = IO_NONE;
    io->ptr = io->len = 0;
    return dir;
}

#include "http_workset.h"
#include "http_enrich.h"
#include "http_scan.h"
#include "http2_conn.h"
#include "http_conn.h"
#include "http_request.h"
#include "http_response.h"
#include "http2_scan.h"
