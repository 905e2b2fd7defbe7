/* tracejoin: HTTP/1.x requests served on this host, with their traceparent and what the kernel
 * did to each, one fixed-size record per finished request.
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
 * Defines set by agent/probes.py (all integers; no user text is ever pasted in here):
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
#define HDR_WINDOW 4096         /* request bytes scanned for headers, request line included */
#define MAX_PENDING 8           /* requests open on one connection (pipelining) */
#define CL_MAX (1ULL << 40)
#define PREFIX_MAX 16           /* carried request-line bytes: a method, a space, a '/' */

#define PROG_SCAN_REQ 0
#define PROG_SCAN_RESP 1

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

struct tstat {
    u64 runq_total, runq_max, offcpu_total, switches;
    u64 minflt, majflt, tlb_a, tlb_b;
    u64 queued_ts, wake_ts, sleep_ts;
    u64 hw_d_in, hw_i_in;       /* counter values at switch-in (TLB_HW) */
    u32 ring_idx, _pad;
    struct runq_wait ring[RUNQ_SLOTS];
};

BPF_RINGBUF_OUTPUT(events, 256);                        /* 256 pages = 1 MiB */
BPF_PERCPU_ARRAY(counters, u64, CNT_MAX);
BPF_PERCPU_ARRAY(scratch_map, struct scratch, 1);
BPF_PERCPU_ARRAY(zero_rec, struct http_record, 1);      /* never written: a zeroed template */
BPF_PERCPU_ARRAY(conn_seq, u64, 1);
BPF_TABLE("lru_hash", u64, struct conn, conns, 16384);
BPF_TABLE("lru_hash", struct req_key, struct http_record, reqs, 16384);
BPF_TABLE("lru_hash", u64, struct pending_io, pending_rd, 16384);
BPF_TABLE("lru_hash", u64, struct pending_io, pending_wr, 16384);
BPF_TABLE("lru_hash", u32, struct tstat, threads, 16384);
BPF_PROG_ARRAY(progs, 2);
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

/* ---------------------------------------------------------------- syscall entry: buffers */

#define DIR_RD 0
#define DIR_WR 1

static __always_inline int remember(int dir, u32 fd, u64 buf, u64 len, u32 has_buf)
{
    u64 id = bpf_get_current_pid_tgid();
    if (!task_allowed(id >> 32))
        return 0;
    struct pending_io p = {.buf = buf, .len = len, .fd = fd, .has_buf = has_buf};
    if (dir == DIR_WR)
        pending_wr.update(&id, &p);
    else
        pending_rd.update(&id, &p);
    return 0;
}

/* The first iovec of readv/writev/recvmsg/sendmsg: headers almost always sit in it. */
static __always_inline int remember_iov(int dir, u32 fd, const struct iovec *iov)
{
    struct iovec first = {};
    if (bpf_probe_read_user(&first, sizeof(first), iov) != 0)
        return remember(dir, fd, 0, 0, 0);
    return remember(dir, fd, (u64)first.iov_base, first.iov_len, 1);
}

static __always_inline int remember_msg(int dir, u32 fd, const struct user_msghdr *msg)
{
    struct user_msghdr m = {};
    if (bpf_probe_read_user(&m, sizeof(m), msg) != 0)
        return remember(dir, fd, 0, 0, 0);
    return remember_iov(dir, fd, m.msg_iov);
}

TRACEPOINT_PROBE(syscalls, sys_enter_read) { return remember(DIR_RD, args->fd, (u64)args->buf, args->count, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvfrom) { return remember(DIR_RD, args->fd, (u64)args->ubuf, args->size, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_readv) { return remember_iov(DIR_RD, args->fd, args->vec); }
TRACEPOINT_PROBE(syscalls, sys_enter_recvmsg) { return remember_msg(DIR_RD, args->fd, args->msg); }
TRACEPOINT_PROBE(syscalls, sys_enter_write) { return remember(DIR_WR, args->fd, (u64)args->buf, args->count, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendto) { return remember(DIR_WR, args->fd, (u64)args->buff, args->len, 1); }
TRACEPOINT_PROBE(syscalls, sys_enter_writev) { return remember_iov(DIR_WR, args->fd, args->vec); }
TRACEPOINT_PROBE(syscalls, sys_enter_sendmsg) { return remember_msg(DIR_WR, args->fd, args->msg); }
/* sendfile: the body never passes through user memory; its bytes are counted, not scanned. */
TRACEPOINT_PROBE(syscalls, sys_enter_sendfile64) { return remember(DIR_WR, args->out_fd, 0, 0, 0); }

/* An entry must not outlive its syscall: a later socket event in this thread (io_uring, say)
 * would otherwise read a stale buffer. */
static __always_inline int forget(int dir)
{
    u64 id = bpf_get_current_pid_tgid();
    if (dir == DIR_WR)
        pending_wr.delete(&id);
    else
        pending_rd.delete(&id);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return forget(DIR_RD); }
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return forget(DIR_RD); }
TRACEPOINT_PROBE(syscalls, sys_exit_readv) { return forget(DIR_RD); }
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) { return forget(DIR_RD); }
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return forget(DIR_WR); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) { return forget(DIR_WR); }
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return forget(DIR_WR); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) { return forget(DIR_WR); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendfile64) { return forget(DIR_WR); }

/* ---------------------------------------------------------------- connections */

static __always_inline u64 new_conn_id(void)
{
    int z = 0;
    u64 *c = conn_seq.lookup(&z);
    if (!c)
        return 0;
    (*c)++;
    return ((u64)bpf_get_smp_processor_id() << 48) | *c;
}

static __always_inline void emit(struct http_record *rec)
{
    count(CNT_RECORDS_SUBMITTED);
    if (events.ringbuf_output(rec, sizeof(*rec), 0) != 0)
        count(CNT_RINGBUF_FULL);
}

/* Snapshot per-thread totals into the record as negatives; finish_request adds the totals at
 * the end, leaving the delta without a second copy of the baseline. */
static __always_inline void start_thread_stats(struct http_record *rec, u32 tid)
{
    struct tstat zero = {};
    struct tstat *t = threads.lookup(&tid);
    if (!t) {
        threads.update(&tid, &zero);
        t = threads.lookup(&tid);
        if (!t)
            return;
    }
    t->runq_max = 0;
    rec->runq_ns = -t->runq_total;
    rec->offcpu_ns = -t->offcpu_total;
    rec->tlb_a = -t->tlb_a;
    rec->tlb_b = -t->tlb_b;
    rec->minflt = -(u32)t->minflt;
    rec->majflt = -(u32)t->majflt;
    rec->nr_switches = -(u32)t->switches;
}

static __always_inline void finish_request(struct http_record *rec, struct conn *c, u64 end_ns)
{
    rec->end_ns = end_ns;
    rec->retrans += c->retrans;
    rec->srtt_us = c->srtt_us;
    rec->unacked_max = c->unacked_max;
    u32 tid = rec->tid;
    struct tstat *t = threads.lookup(&tid);
    if (!t) {
        rec->runq_ns = rec->offcpu_ns = rec->tlb_a = rec->tlb_b = 0;
        rec->minflt = rec->majflt = rec->nr_switches = 0;
        return;
    }
    rec->runq_ns += t->runq_total;
    rec->runq_max_ns = t->runq_max;
    rec->offcpu_ns += t->offcpu_total;
    rec->tlb_a += t->tlb_a;
    rec->tlb_b += t->tlb_b;
    rec->minflt += (u32)t->minflt;
    rec->majflt += (u32)t->majflt;
    rec->nr_switches += (u32)t->switches;
    u64 from = rec->arrival_ns ? rec->arrival_ns : rec->read_ns;
    u32 k = 0;
#pragma unroll
    for (int i = 0; i < RUNQ_SLOTS; i++) {
        struct runq_wait w = t->ring[i];
        if (w.dur_ns && w.start_ns >= from && w.start_ns <= end_ns && k < RUNQ_SLOTS) {
            rec->runq[k & (RUNQ_SLOTS - 1)] = w;
            k++;
        }
    }
#ifdef TLB_HW
    rec->flags |= REQF_TLB_HW;
#endif
}

/* Emit and forget every request still open on a connection that is going away. */
static __always_inline void flush_conn(u64 sk, struct conn *c, u64 now)
{
    struct req_key key = {.sk = sk};
#pragma unroll
    for (int i = 0; i < MAX_PENDING; i++) {
        if (c->head >= c->tail)
            break;
        key.seq = c->head;
        struct http_record *rec = reqs.lookup(&key);
        if (rec) {
            if (rec->resp_start_ns) {
                rec->flags |= REQF_RESP_UNTERM;
                finish_request(rec, c, c->last_write_ns);
            } else {
                rec->flags |= REQF_NO_RESPONSE;
                finish_request(rec, c, now);
            }
            rec->status = c->rs_status;
            emit(rec);
            reqs.delete(&key);
        } else {
            count(CNT_REQ_STATE_LOST);
        }
        c->head++;
        c->rs_state = RS_STATUS;
        c->rs_status = 0;
    }
}

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != IPPROTO_TCP_)
        return 0;
    u64 sk = (u64)args->skaddr;
    u64 now = bpf_ktime_get_ns();
    if (args->newstate == TCP_ESTABLISHED_) {
        struct conn c = {};
        c.conn_id = new_conn_id();
        c.family = args->family;
        c.lport = args->sport;
        c.rport = args->dport;
        c.flags = CONN_TUPLE;
        if (args->family == AF_INET_) {
            __builtin_memcpy(c.laddr, args->saddr, 4);
            __builtin_memcpy(c.raddr, args->daddr, 4);
        } else {
            __builtin_memcpy(c.laddr, args->saddr_v6, 16);
            __builtin_memcpy(c.raddr, args->daddr_v6, 16);
        }
        if (args->oldstate == TCP_SYN_RECV_) {
            c.est_ns = now;            /* handshake done; the accept backlog wait starts */
#ifdef FILTER_PORT
            u16 port = args->sport;
            if (!filter_port.lookup(&port))
                c.flags |= CONN_IGNORED;
#endif
        } else {
            c.flags |= CONN_IGNORED;   /* a connection this host opened: a client, not served */
        }
        conns.update(&sk, &c);
        return 0;
    }
    /* We are closing (or the connection was reset): whatever is open has ended. The peer's FIN
     * alone (CLOSE_WAIT) does not end anything: a half-closed client still gets its response. */
    if (args->newstate == TCP_FIN_WAIT1_ || args->newstate == TCP_LAST_ACK_ ||
        args->newstate == TCP_CLOSE_) {
        struct conn *c = conns.lookup(&sk);
        if (c)
            flush_conn(sk, c, now);
    }
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_destroy_sock)
{
    u64 sk = (u64)args->skaddr;
    struct conn *c = conns.lookup(&sk);
    if (!c)
        return 0;
    flush_conn(sk, c, bpf_ktime_get_ns());
    conns.delete(&sk);
    return 0;
}

#ifdef WITH_TUPLE_AT_READ
/* Fires inside every TCP read that copied data, before sock_recv_length, with the socket and
 * its 4-tuple: a connection older than the agent, or evicted from `conns`, gets its tuple (and
 * the port filter) here rather than from /proc. Only threads that passed the pid/comm filters
 * at syscall entry (a pending read) create state. */
TRACEPOINT_PROBE(tcp, tcp_rcv_space_adjust)
{
    u64 sk = (u64)args->skaddr;
    struct conn *c = conns.lookup(&sk);
    if (c && (c->flags & CONN_TUPLE))
        return 0;
    if (!c) {
        u64 id = bpf_get_current_pid_tgid();
        if (!pending_rd.lookup(&id))
            return 0;
        struct conn fresh = {};
        fresh.conn_id = new_conn_id();
        conns.update(&sk, &fresh);
        c = conns.lookup(&sk);
        if (!c)
            return 0;
    }
    c->family = args->family;
    c->lport = args->sport;
    c->rport = args->dport;
    if (args->family == AF_INET_) {
        __builtin_memcpy(c->laddr, args->saddr, 4);
        __builtin_memcpy(c->raddr, args->daddr, 4);
    } else {
        __builtin_memcpy(c->laddr, args->saddr_v6, 16);
        __builtin_memcpy(c->raddr, args->daddr_v6, 16);
    }
    c->flags |= CONN_TUPLE;
#ifdef FILTER_PORT
    u16 port = args->sport;
    if (!filter_port.lookup(&port))
        c->flags |= CONN_IGNORED;
#endif
    return 0;
}
#endif

#ifdef WITH_RECVQ
TRACEPOINT_PROBE(sock, sk_data_ready)
{
    u64 sk = (u64)args->skaddr;
    struct conn *c = conns.lookup(&sk);
    if (c && c->arrival_ns == 0)
        c->arrival_ns = bpf_ktime_get_ns();
    return 0;
}
#endif

#ifdef WITH_TCPSTATS
TRACEPOINT_PROBE(tcp, tcp_retransmit_skb)
{
    u64 sk = (u64)args->skaddr;
    struct conn *c = conns.lookup(&sk);
    if (c)
        c->retrans++;
    return 0;
}

TRACEPOINT_PROBE(tcp, tcp_probe)
{
    u64 sk = (u64)args->skaddr;
    struct conn *c = conns.lookup(&sk);
    if (c) {
        c->srtt_us = args->srtt;
        u32 inflight = args->snd_nxt - args->snd_una;
        if (inflight > c->unacked_max)
            c->unacked_max = inflight;
    }
    return 0;
}
#endif

/* ---------------------------------------------------------------- socket data */

static __always_inline struct scratch *load_scratch(u64 sk, struct pending_io *p, int ret)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    if (!s)
        return 0;
    s->sk = sk;
    s->now = bpf_ktime_get_ns();
    s->total = ret;
    s->off = 0;
    s->fd = p->fd;
    s->chain = 0;
    s->n = 0;
    if (p->has_buf) {
        u64 n = ret;
        if (n > p->len)
            n = p->len;
        if (n > SCRATCH_SIZE)
            n = SCRATCH_SIZE;
        u32 sz = n;
        if (sz > SCRATCH_SIZE)
            sz = SCRATCH_SIZE;
        if (sz > 0 && bpf_probe_read_user(s->buf, sz, (void *)p->buf) == 0)
            s->n = sz;
        else if (sz > 0)
            count(CNT_READ_NO_COPY);
    }
    return s;
}

static __always_inline int is_tcp(u16 family, u16 protocol)
{
    return (family == AF_INET_ || family == AF_INET6_) && protocol == IPPROTO_TCP_;
}

TRACEPOINT_PROBE(sock, sock_recv_length)
{
    if (args->ret <= 0 || !is_tcp(args->family, args->protocol) || (args->flags & MSG_PEEK_))
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    struct pending_io *p = pending_rd.lookup(&id);
    if (!p)
        return 0;
    u64 sk = (u64)args->sk;
    struct conn *c = conns.lookup(&sk);
    if (!c) {
        /* A connection from before we started (or evicted): track it without its tuple;
         * user space resolves the tuple from the fd. */
        struct conn fresh = {};
        fresh.conn_id = new_conn_id();
#if defined(FILTER_PORT) && !defined(WITH_TUPLE_AT_READ)
        /* Its port is unknown here (no tcp_rcv_space_adjust), so the port filter cannot
         * admit it: a filter must never let another port through (docs/probes.md). */
        fresh.flags = CONN_IGNORED;
#endif
        conns.update(&sk, &fresh);
        c = conns.lookup(&sk);
        if (!c)
            return 0;
    }
    if (c->flags & CONN_IGNORED)
        return 0;
    if (!load_scratch(sk, p, args->ret))
        return 0;
    pending_rd.delete(&id);
    progs.call(args, PROG_SCAN_REQ);
    return 0;
}

TRACEPOINT_PROBE(sock, sock_send_length)
{
    if (args->ret <= 0 || !is_tcp(args->family, args->protocol))
        return 0;
    u64 sk = (u64)args->sk;
    struct conn *c = conns.lookup(&sk);
    if (!c || (c->flags & CONN_IGNORED) || c->head >= c->tail)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    struct pending_io *p = pending_wr.lookup(&id);
    struct pending_io none = {};
    if (!p)
        p = &none;
    struct scratch *s = load_scratch(sk, p, args->ret);
    if (!s)
        return 0;
    c->last_write_ns = s->now;
    /* sendfile calls sock_sendmsg once per chunk: only the first event may use a buffer */
    if (p->has_buf)
        pending_wr.delete(&id);
    progs.call(args, PROG_SCAN_RESP);
    return 0;
}

/* ---------------------------------------------------------------- request scanner */

static __always_inline u8 lc(u8 ch)
{
    return (ch >= 'A' && ch <= 'Z') ? ch + 32 : ch;
}

#define BYTE(i) (s->buf[(i) & (SCRATCH_SIZE - 1)])

/* Case-insensitive match of a lowercase header name plus ':' at offset i (fully inside buf). */
static __always_inline int hdr_is(struct scratch *s, u32 i, const char *name, u32 len)
{
    if (i + len + 1 > s->n)
        return 0;
#pragma unroll
    for (u32 k = 0; k < 18; k++) {
        if (k >= len)
            break;
        if (lc(BYTE(i + k)) != (u8)name[k])
            return 0;
    }
    return BYTE(i + len) == ':';
}

/* Byte k of the data at a request boundary: bytes carried from earlier reads come first. */
static __always_inline u8 peek(struct scratch *s, struct conn *c, u32 k)
{
    u32 pl = c->rq_plen;
    if (k < pl)
        return c->rq_prefix[k & (PREFIX_MAX - 1)];
    return BYTE(s->off + k - pl);
}

#define NEED_MORE 0xff

/* A method followed by a space and the start of a request target: the method's length; 0 when
 * this is not a request line; NEED_MORE when too few bytes have arrived to tell. */
static __always_inline u32 method_at(struct scratch *s, struct conn *c)
{
    u32 avail = c->rq_plen + (s->n > s->off ? s->n - s->off : 0);
    if (avail < 4) {
        for (u32 k = 0; k < 3; k++)
            if (k < avail && (peek(s, c, k) < 'A' || peek(s, c, k) > 'Z'))
                return 0;
        return NEED_MORE;
    }
    u8 a = peek(s, c, 0), b = peek(s, c, 1), d = peek(s, c, 2), e = peek(s, c, 3);
    u32 len = 0;
    if (a == 'G' && b == 'E' && d == 'T') len = 3;
    else if (a == 'P' && b == 'U' && d == 'T') len = 3;
    else if (a == 'P' && b == 'O' && d == 'S' && e == 'T') len = 4;
    else if (a == 'H' && b == 'E' && d == 'A' && e == 'D') len = 4;
    else if (a == 'P' && b == 'A' && d == 'T' && e == 'C') len = 5;
    else if (a == 'D' && b == 'E' && d == 'L' && e == 'E') len = 6;
    else if (a == 'O' && b == 'P' && d == 'T' && e == 'I') len = 7;
    else if (a == 'T' && b == 'R' && d == 'A' && e == 'C') len = 5;
    else if (a == 'C' && b == 'O' && d == 'N' && e == 'N') len = 7;
    if (!len)
        return 0;
    if (avail < len + 2)
        return NEED_MORE;
    if (peek(s, c, len) != ' ')
        return 0;
    u8 t = peek(s, c, len + 1);
    if (t != '/' && t != '*' && t != 'h')   /* origin-, asterisk- or absolute-form target */
        return 0;
    return len;
}

/* Keep the few bytes of a request line that arrived alone, for the next read. */
static __always_inline void carry_prefix(struct scratch *s, struct conn *c)
{
#pragma unroll
    for (u32 k = 0; k < PREFIX_MAX - 1; k++) {
        u32 pl = c->rq_plen;
        if (s->off >= s->n || pl >= PREFIX_MAX - 1)
            break;
        c->rq_prefix[pl & (PREFIX_MAX - 1)] = BYTE(s->off);
        c->rq_plen = pl + 1;
        s->off++;
    }
}

/* A request line begins at s->off: open a record for it. Returns the record or 0. */
static __always_inline struct http_record *open_request(struct scratch *s, struct conn *c, u32 mlen)
{
    if (c->tail - c->head >= MAX_PENDING) {
        count(CNT_SLOTS_FULL);
        return 0;
    }
    int z = 0;
    struct http_record *tmpl = zero_rec.lookup(&z);
    if (!tmpl)
        return 0;
    struct req_key key = {.sk = s->sk, .seq = c->tail};
    if (reqs.update(&key, tmpl) != 0)
        return 0;
    struct http_record *rec = reqs.lookup(&key);
    if (!rec)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    rec->type = REC_HTTP;
    rec->pid = id >> 32;
    rec->tid = (u32)id;
    rec->fd = s->fd;
    rec->conn_id = c->conn_id;
    rec->seq = c->tail;
    rec->read_ns = s->now;
    rec->arrival_ns = (c->arrival_ns && c->arrival_ns <= s->now) ? c->arrival_ns : 0;
    if (!(c->flags & CONN_SEEN_REQ)) {
        rec->flags |= REQF_FIRST_ON_CONN;
        rec->est_ns = c->est_ns;
    }
    if (c->flags & CONN_TUPLE) {
        rec->flags |= REQF_TUPLE;
        rec->family = c->family;
        rec->lport = c->lport;
        rec->rport = c->rport;
        __builtin_memcpy(rec->laddr, c->laddr, 16);
        __builtin_memcpy(rec->raddr, c->raddr, 16);
    }
    rec->method_len = mlen;
#pragma unroll
    for (u32 k = 0; k < HTTP_METHOD_MAX; k++)
        if (k < mlen)
            rec->method[k] = peek(s, c, k);
    rec->retrans = -c->retrans;
    start_thread_stats(rec, rec->tid);
    c->flags |= CONN_SEEN_REQ;
    c->tail++;
    c->rq_state = RQ_PATH;
    c->rq_scanned = mlen + 1;
    c->rq_cl = 0;
    c->rq_tpraw = 0;
    s->off += mlen + 1 - c->rq_plen;   /* carried bytes are never more than method + space */
    c->rq_plen = 0;
    return rec;
}

/* Scanner steps keep their position and state in map memory, re-read every step (VLD), so the
 * verifier sees the same abstract state at every loop head and prunes: a few hundred
 * instructions per step instead of a state per (state, offset) pair. */
#define VLD(x) (*(volatile typeof(x) *)&(x))
enum { STEP_GO, STEP_STOP, STEP_NEXT };

/* Skip up to *left bytes of a framed body; true when the body is complete. */
static __always_inline int skip_body(struct scratch *s, u32 i, u64 *left, u64 *counted)
{
    u64 avail = s->total - i, body = *left;
    u64 skip = body < avail ? body : avail;
    *counted += skip;
    s->off = i + skip;
    *left = body - skip;
    return body == skip;
}

/* One byte of a Content-Length value: accumulate digits; returns the next parser state
 * (`same` while in the value, `line_start` at LF, `skip_line` on anything else). */
static __always_inline u8 cl_byte(u64 *cl, u8 ch, u8 same, u8 line_start, u8 skip_line)
{
    if (ch >= '0' && ch <= '9') {
        if (*cl < CL_MAX)
            *cl = *cl * 10 + (ch - '0');
        return same;
    }
    if (ch == '\n')
        return line_start;
    return (ch == ' ' || ch == '\t') ? same : skip_line;
}

static __always_inline int step_req(struct scratch *s, struct conn *c, struct http_record *rec)
{
    u32 i = VLD(s->off);
    u8 st = VLD(c->rq_state);
    if (i >= s->total)
        return STEP_STOP;
    if (st == RQ_BODY) {
        if (!skip_body(s, i, &c->rq_body, &rec->req_bytes))
            return STEP_STOP;
        c->rq_state = RQ_NONE;
        return STEP_NEXT;
    }
    if (st == RQ_UNFRAMED || st == RQ_OVERFLOW || st == RQ_NONE) {
        if (st != RQ_NONE)
            rec->req_bytes += s->total - i;
        s->off = s->total;
        return STEP_STOP;
    }
    if (i >= s->n) {
        if (s->total > s->n) {      /* headers go on past what we could copy: the window */
            rec->flags |= REQF_TP_WINDOW;
            c->rq_state = RQ_OVERFLOW;
            return STEP_GO;
        }
        return STEP_STOP;
    }
    if (c->rq_scanned >= HDR_WINDOW) {
        rec->flags |= REQF_TP_WINDOW;
        c->rq_state = RQ_OVERFLOW;
        return STEP_GO;
    }
    u8 ch = BYTE(i);
    u32 adv = 1;
    int ret = STEP_GO;
    int hdr_end = 0;
    if (st == RQ_PATH) {
        if (ch == ' ' || ch == '?' || ch == '\r') {
            st = RQ_LINE_REST;
        } else if (ch == '\n') {
            st = RQ_LINE_START;
        } else {
            u32 pl = rec->path_len;
            if (pl < HTTP_PATH_MAX) {
                rec->path[pl] = ch;
                rec->path_len = pl + 1;
            } else {
                rec->flags |= REQF_PATH_TRUNC;
            }
        }
    } else if (st == RQ_LINE_REST || st == RQ_SKIP_LINE) {
        if (ch == '\n')
            st = RQ_LINE_START;
    } else if (st == RQ_LINE_START) {
        if (ch == '\r') {
            st = RQ_CR;
        } else if (ch == '\n') {
            hdr_end = 1;
        } else if (hdr_is(s, i, "traceparent", 11)) {
            if (rec->tp_count < 255)
                rec->tp_count++;
            adv = 12;
            st = rec->tp_count == 1 ? RQ_TP_OWS : RQ_SKIP_LINE;
        } else if (hdr_is(s, i, "content-length", 14)) {
            adv = 15;
            c->rq_cl = 0;
            st = RQ_CL_VALUE;
        } else if (hdr_is(s, i, "transfer-encoding", 17)) {
            adv = 18;
            c->rq_cl = CL_MAX;      /* a chunked request body: framing we do not follow */
            st = RQ_SKIP_LINE;
        } else {
            st = RQ_SKIP_LINE;
        }
    } else if (st == RQ_CR) {
        if (ch == '\n')
            hdr_end = 1;
        else
            st = RQ_SKIP_LINE;
    } else if (st == RQ_TP_OWS || st == RQ_TP_VALUE) {
        if (ch == '\r') {
            st = RQ_SKIP_LINE;
        } else if (ch == '\n') {
            st = RQ_LINE_START;
        } else if (st == RQ_TP_OWS && (ch == ' ' || ch == '\t')) {
            /* optional whitespace before the value */
        } else {
            st = RQ_TP_VALUE;
            u32 pos = c->rq_tpraw;
            if (pos < TP_CAP)
                rec->tp[pos] = ch;
            if (pos < 0xffff)
                c->rq_tpraw = pos + 1;
            if (ch != ' ' && ch != '\t')
                rec->tp_len = c->rq_tpraw;
        }
    } else if (st == RQ_CL_VALUE) {
        st = cl_byte(&c->rq_cl, ch, RQ_CL_VALUE, RQ_LINE_START, RQ_SKIP_LINE);
    }
    if (hdr_end) {
        rec->flags |= REQF_HDR_DONE;
        u64 cl = c->rq_cl;
        if (cl >= CL_MAX) {
            st = RQ_UNFRAMED;
        } else if (cl > 0) {
            c->rq_body = cl;
            st = RQ_BODY;
        } else {
            st = RQ_NONE;
            ret = STEP_NEXT;
        }
    }
    s->off = i + adv;
    c->rq_scanned += adv;
    rec->req_bytes += adv;
    c->rq_state = st;
    return ret;
}

int scan_req(void *ctx)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    if (!s)
        return 0;
    u64 sk = s->sk;
    struct conn *c = conns.lookup(&sk);
    if (!c)
        return 0;
    struct http_record *rec = 0;
    if (c->rq_state == RQ_NONE) {
        if (s->off >= s->total)
            goto out;
        u32 mlen = method_at(s, c);
        if (mlen == NEED_MORE) {
            carry_prefix(s, c);
            return 0;   /* keep the arrival time: the request has begun to arrive */
        }
        if (!mlen) {
            c->rq_plen = 0;
            if (!(c->flags & CONN_SEEN_REQ)) {
                /* A response being read ("HTTP/"): a client's socket we met mid-life (older
                 * than the agent, or evicted), not a non-HTTP server connection. */
                if (!(s->n - s->off >= 5 && BYTE(s->off) == 'H' && BYTE(s->off + 1) == 'T' &&
                      BYTE(s->off + 2) == 'T' && BYTE(s->off + 3) == 'P' &&
                      BYTE(s->off + 4) == '/'))
                    count(CNT_NON_HTTP);
                c->flags |= CONN_IGNORED;
            }
            goto out;   /* not a request line: an unframed body, or noise: skip this read */
        }
        rec = open_request(s, c, mlen);
        if (!rec)
            goto out;
    } else {
        struct req_key key = {.sk = sk, .seq = c->tail - 1};
        rec = reqs.lookup(&key);
        if (!rec) {
            count(CNT_REQ_STATE_LOST);
            c->rq_state = RQ_NONE;
            goto out;
        }
        if (s->off == 0 && c->rq_state == RQ_TP_VALUE)
            rec->flags |= REQF_TP_SPLIT;
    }
    int r = STEP_GO;
#pragma unroll 1
    for (int iter = 0; iter < SCAN_CHUNK; iter++) {
        r = step_req(s, c, rec);
        if (r != STEP_GO)
            break;
    }
    if (r != STEP_STOP && s->off < s->total && s->chain < 30) {
        s->chain++;
        progs.call(ctx, PROG_SCAN_REQ);
    }
out:
    /* This read is fully scanned: every request it opened took the arrival time; the next
     * arrival is new data. */
    c->arrival_ns = 0;
    return 0;
}

/* ---------------------------------------------------------------- response scanner */

/* "HTTP/1.x NNN" at offset i: the status code, or 0. */
static __always_inline u16 status_at(struct scratch *s, u32 i)
{
    if (i + 12 > s->n)
        return 0;
    if (BYTE(i) != 'H' || BYTE(i + 1) != 'T' || BYTE(i + 2) != 'T' || BYTE(i + 3) != 'P' ||
        BYTE(i + 4) != '/' || BYTE(i + 5) != '1' || BYTE(i + 6) != '.' || BYTE(i + 8) != ' ')
        return 0;
    u8 a = BYTE(i + 9), b = BYTE(i + 10), d = BYTE(i + 11);
    if (a < '1' || a > '5' || b < '0' || b > '9' || d < '0' || d > '9')
        return 0;
    return (a - '0') * 100 + (b - '0') * 10 + (d - '0');
}


/* The response to rec ended: emit it and move on to the next open request. */
static __always_inline void complete_response(struct scratch *s, struct conn *c,
                                              struct http_record *rec)
{
    rec->status = c->rs_status;
    finish_request(rec, c, s->now);
    emit(rec);
    struct req_key key = {.sk = s->sk, .seq = c->head};
    reqs.delete(&key);
    c->head++;
    c->rs_state = RS_STATUS;
    c->rs_status = 0;
}

static __always_inline int step_resp(struct scratch *s, struct conn *c, struct http_record *rec)
{
    u32 i = VLD(s->off);
    u8 st = VLD(c->rs_state);
    if (i >= s->total)
        return STEP_STOP;
    if (st == RS_BODY)
        return skip_body(s, i, &c->rs_body, &rec->resp_bytes) ? STEP_NEXT : STEP_STOP;
    if (st == RS_CHUNKED) {
        /* The body ends with the "0\r\n\r\n" chunk: keep the last 5 bytes written. */
        u32 end = s->total;
        if (end <= s->n && end - i >= 5) {
#pragma unroll
            for (int k = 0; k < 5; k++)
                c->rs_tail[k] = BYTE(end - 5 + k);
        } else if (end <= s->n) {
#pragma unroll
            for (int k = 0; k < 5; k++) {
                if (i + k < end) {
                    c->rs_tail[0] = c->rs_tail[1];
                    c->rs_tail[1] = c->rs_tail[2];
                    c->rs_tail[2] = c->rs_tail[3];
                    c->rs_tail[3] = c->rs_tail[4];
                    c->rs_tail[4] = BYTE(i + k);
                }
            }
        } else {
            c->rs_tail[0] = 0;      /* the tail lies beyond what we copied: cannot tell */
        }
        rec->resp_bytes += end - i;
        s->off = end;
        if (c->rs_tail[0] == '0' && c->rs_tail[1] == '\r' && c->rs_tail[2] == '\n' &&
            c->rs_tail[3] == '\r' && c->rs_tail[4] == '\n')
            return STEP_NEXT;
        return STEP_STOP;
    }
    if (st == RS_OPAQUE) {
        rec->resp_bytes += s->total - i;
        s->off = s->total;
        return STEP_STOP;
    }
    if (i >= s->n)
        return STEP_STOP;
    if (st == RS_STATUS) {
        u16 code = status_at(s, i);
        if (!code) {
            rec->flags |= REQF_RESP_UNTERM;
            c->rs_state = RS_OPAQUE;
            return STEP_GO;
        }
        c->rs_status = code;
        c->rs_cl = CL_MAX;          /* unknown until a Content-Length header says */
        c->rs_chunked = 0;
        rec->resp_bytes += 12;
        s->off = i + 12;
        c->rs_state = RS_LINE_REST;
        return STEP_GO;
    }
    u8 ch = BYTE(i);
    u32 adv = 1;
    int ret = STEP_GO;
    int hdr_end = 0;
    if (st == RS_LINE_REST || st == RS_SKIP_LINE) {
        if (ch == '\n')
            st = RS_LINE_START;
    } else if (st == RS_LINE_START) {
        if (ch == '\r') {
            st = RS_CR;
        } else if (ch == '\n') {
            hdr_end = 1;
        } else if (hdr_is(s, i, "content-length", 14)) {
            adv = 15;
            c->rs_cl = 0;
            st = RS_CL_VALUE;
        } else if (hdr_is(s, i, "transfer-encoding", 17)) {
            adv = 18;
            c->rs_chunked = 1;
            st = RS_SKIP_LINE;
        } else {
            st = RS_SKIP_LINE;
        }
    } else if (st == RS_CR) {
        if (ch == '\n')
            hdr_end = 1;
        else
            st = RS_SKIP_LINE;
    } else if (st == RS_CL_VALUE) {
        st = cl_byte(&c->rs_cl, ch, RS_CL_VALUE, RS_LINE_START, RS_SKIP_LINE);
    }
    if (hdr_end) {
        u16 code = c->rs_status;
        int head = rec->method_len == 4 && rec->method[0] == 'H';
        if (code >= 100 && code < 200 && code != 101) {
            st = RS_STATUS;         /* interim (100 Continue): the final response follows */
        } else if (head || code == 204 || code == 304 || code == 101) {
            if (code == 101)
                c->flags |= CONN_IGNORED;   /* upgraded: no longer HTTP/1.x */
            ret = STEP_NEXT;
        } else if (c->rs_chunked) {
            c->rs_tail[0] = 0;
            st = RS_CHUNKED;
        } else if (c->rs_cl < CL_MAX) {
            c->rs_body = c->rs_cl;
            st = RS_BODY;
            if (c->rs_cl == 0)
                ret = STEP_NEXT;
        } else {
            st = RS_OPAQUE;         /* close-delimited: ends when the connection does */
            rec->flags |= REQF_RESP_UNTERM;
        }
    }
    s->off = i + adv;
    rec->resp_bytes += adv;
    c->rs_state = st;
    return ret;
}

int scan_resp(void *ctx)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    if (!s)
        return 0;
    u64 sk = s->sk;
    struct conn *c = conns.lookup(&sk);
    if (!c || c->head >= c->tail)
        return 0;
    struct req_key key = {.sk = sk, .seq = c->head};
    struct http_record *rec = reqs.lookup(&key);
    if (!rec) {
        count(CNT_REQ_STATE_LOST);
        c->head++;
        c->rs_state = RS_STATUS;
        return 0;
    }
    if (!rec->resp_start_ns) {
        rec->resp_start_ns = s->now;
        c->unacked_max = 0;
        /* The server answers the latest request: whatever its headers did, it has been read.
         * A parser that lost the header end (window, unframed body) restarts here. */
        u8 rq = c->rq_state;
        if (c->head + 1 == c->tail && rq != RQ_NONE && rq != RQ_BODY)
            c->rq_state = RQ_NONE;
    }
    int r = STEP_GO;
#pragma unroll 1
    for (int iter = 0; iter < SCAN_CHUNK; iter++) {
        r = step_resp(s, c, rec);
        if (r != STEP_GO)
            break;
    }
    if (r == STEP_NEXT)
        complete_response(s, c, rec);
    /* more bytes: the same response's headers, or pipelined responses sharing one write */
    if (r != STEP_STOP && s->off < s->total && c->head < c->tail && s->chain < 30) {
        s->chain++;
        progs.call(ctx, PROG_SCAN_RESP);
    }
    return 0;
}

/* ---------------------------------------------------------------- thread enrichment */

static __always_inline void note_runq_wait(struct tstat *t, u64 start, u64 now)
{
    u64 d = now - start;
    t->runq_total += d;
    if (d > t->runq_max)
        t->runq_max = d;
    if (d >= RUNQ_THRESHOLD_NS) {
        u32 k = t->ring_idx & (RUNQ_SLOTS - 1);
        t->ring[k].start_ns = start;
        t->ring[k].dur_ns = d;
        t->ring_idx++;
    }
}

#ifdef WITH_SCHED
TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid, next = args->next_pid;
    struct tstat *t = threads.lookup(&prev);
    if (t) {
        t->switches++;
        if (args->prev_state == 0)      /* TASK_RUNNING: preempted, still runnable */
            t->queued_ts = now;
        else
            t->sleep_ts = now;
#ifdef TLB_HW
        int cpu = bpf_get_smp_processor_id();
        u64 d = dtlb.perf_read(cpu), ii = itlb.perf_read(cpu);
        if ((s64)d >= 0 && t->hw_d_in && d >= t->hw_d_in)
            t->tlb_a += d - t->hw_d_in;
        if ((s64)ii >= 0 && t->hw_i_in && ii >= t->hw_i_in)
            t->tlb_b += ii - t->hw_i_in;
#endif
    }
    t = threads.lookup(&next);
    if (t) {
        if (t->queued_ts) {
            note_runq_wait(t, t->queued_ts, now);
            t->queued_ts = 0;
        } else if (t->wake_ts) {
            note_runq_wait(t, t->wake_ts, now);
            t->wake_ts = 0;
        }
#ifdef TLB_HW
        int cpu = bpf_get_smp_processor_id();
        t->hw_d_in = dtlb.perf_read(cpu);
        t->hw_i_in = itlb.perf_read(cpu);
#endif
    }
    return 0;
}

static __always_inline int on_wakeup(u32 pid)
{
    struct tstat *t = threads.lookup(&pid);
    if (!t)
        return 0;
    u64 now = bpf_ktime_get_ns();
    if (t->sleep_ts) {
        t->offcpu_total += now - t->sleep_ts;
        t->sleep_ts = 0;
    }
    t->wake_ts = now;
    return 0;
}

TRACEPOINT_PROBE(sched, sched_wakeup) { return on_wakeup(args->pid); }
TRACEPOINT_PROBE(sched, sched_wakeup_new) { return on_wakeup(args->pid); }
#endif

#ifdef WITH_FAULTS
/* Software perf events (sample_period 1) run in the faulting thread and tell minor from major,
 * which the exceptions:page_fault_user tracepoint (fired before the fault is handled) cannot. */
int on_minflt(struct bpf_perf_event_data *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct tstat *t = threads.lookup(&tid);
    if (t)
        t->minflt++;
    return 0;
}

int on_majflt(struct bpf_perf_event_data *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct tstat *t = threads.lookup(&tid);
    if (t)
        t->majflt++;
    return 0;
}
#endif

#if defined(WITH_TLB_FLUSH) && !defined(TLB_HW)
/* Fallback without a PMU: TLB *flushes* involving this thread, not misses (see docs/attributes.md). */
TRACEPOINT_PROBE(tlb, tlb_flush)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct tstat *t = threads.lookup(&tid);
    if (t) {
        t->tlb_a++;
        if (args->pages == (unsigned long)-1)
            t->tlb_b++;
    }
    return 0;
}
#endif
