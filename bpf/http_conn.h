/* Connection lifecycle: syscall exits, connection state from the TCP state machine, the
 * socket-data tracepoints that hand each read/write to a scanner, and the flush on close.
 * Part of the bpf/http.c compile unit.
 */

/* ---------------------------------------------------------------- syscall exit */

/* The exit of every read and write the scanners read (syscall_dir): finish what the socket
 * event in it left for later. Nothing else: any thread's read or write passes here, socket or
 * not, and pays one per-CPU array read. */
static __always_inline int syscall_exit(void *ctx)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    if (!s)
        return 0;
    u32 more = s->h2_more;
    if (more && more != H2_MORE_EXIT && s->h2_tid == (u32)bpf_get_current_pid_tgid()) {
        /* an HTTP/2 scan this syscall ran out of tail calls for: the exit is a new program
         * run with a budget of its own, and the buffer is still the one the data went to;
         * the scan runs the notes when it is done (h2_done) */
        s->h2_more = H2_MORE_EXIT;
        s->chain = 0;
        progs.call(ctx, more - 1);
    }
    if (s->nnotes)              /* requests this syscall opened or ended (http_enrich.h) */
        progs.call(ctx, PROG_RUN_NOTES);
    return 0;
}
TRACEPOINT_PROBE(syscalls, sys_exit_read) { return syscall_exit(args); }
TRACEPOINT_PROBE(syscalls, sys_exit_recvfrom) { return syscall_exit(args); }
TRACEPOINT_PROBE(syscalls, sys_exit_readv) { return syscall_exit(args); }
TRACEPOINT_PROBE(syscalls, sys_exit_recvmsg) { return syscall_exit(args); }
TRACEPOINT_PROBE(syscalls, sys_exit_write) { return syscall_exit(args); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendto) { return syscall_exit(args); }
TRACEPOINT_PROBE(syscalls, sys_exit_writev) { return syscall_exit(args); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendmsg) { return syscall_exit(args); }
TRACEPOINT_PROBE(syscalls, sys_exit_sendfile64) { return syscall_exit(args); }

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

/* 8 lowercase hex digits, loaded little-endian from text, as the number they spell (no loop: a
 * fixed 20 instructions). Each byte becomes its nibble ('a'-'f' have bit 6 set: +9), then the
 * nibbles are packed most significant first. Not validated: user space validates the
 * traceparent, and an invalid one starts a new random trace, for which any decision is fair. */
static __always_inline u64 hex8(u64 x)
{
    u64 v = (x & 0x0F0F0F0F0F0F0F0FULL) + ((x >> 6) & 0x0101010101010101ULL) * 9;
    v = __builtin_bswap64(v);
    v = (v | (v >> 4)) & 0x00FF00FF00FF00FFULL;
    v = (v | (v >> 8)) & 0x0000FFFF0000FFFFULL;
    return (v | (v >> 16)) & 0xFFFFFFFFULL;
}

/* A new request's record (HTTP/1.x request c->tail, HTTP/2 stream `seq`): who read it, on which
 * connection, and the thread totals its kernel signals are measured from. */
static __always_inline void open_record(struct scratch *s, struct conn *c,
                                        struct http_record *rec, u64 seq)
{
    u64 id = bpf_get_current_pid_tgid();
    rec->type = REC_HTTP;
    rec->pid = id >> 32;
    rec->tid = (u32)id;
    rec->fd = s->fd;
    rec->conn_id = c->conn_id;
    rec->seq = seq;
    if (!(c->flags & CONN_SEEN_REQ)) {
        c->flags |= CONN_SEEN_REQ;
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
    rec->retrans = -c->retrans;
    start_thread_stats(s, rec);
}

/* Whether the overload budget keeps this request (struct sampling in http_record.h). */
static __always_inline int budget_keeps(struct http_record *rec)
{
    int z = 0;
    struct sampling *sm = sampling.lookup(&z);
    if (!sm || !sm->active)
        return 1;
    /* "vv-<32 hex trace id>-<16 hex parent id>-<2 hex flags>": the id's low 8 bytes are
     * characters 19..34 */
    if (rec->tp_len >= 55 && rec->tp[2] == '-' && rec->tp[35] == '-' && rec->tp[52] == '-') {
        u64 hi, lo;
        __builtin_memcpy(&hi, &rec->tp[19], 8);
        __builtin_memcpy(&lo, &rec->tp[27], 8);
        return ((hex8(hi) << 32) | hex8(lo)) < sm->bound;
    }
    /* No trace id to agree on: user space will start a new random one; draw as randomly. */
    return (((u64)bpf_get_prandom_u32() << 32) | bpf_get_prandom_u32()) < sm->bound;
}

/* Branch-free tests (1 or 0): the request scanner is near the verifier's limit, and every
 * branch here would multiply the paths it walks. */
static __always_inline u64 is_zero(u64 x)
{
    return (~x & (x - 1)) >> 63;
}

/* Each of the 8 bytes is a lowercase hex digit. With every high bit clear, adding (0x80 - lo)
 * to a byte sets its high bit iff it is >= lo, and adding (0x7f - hi) iff it is > hi; no byte
 * carries into the next. */
static __always_inline u64 lhex8(u64 x)
{
    const u64 ones = 0x0101010101010101ULL, high = 0x8080808080808080ULL;
    u64 digit = (x + (0x80 - '0') * ones) & ~(x + (0x7f - '9') * ones);
    u64 lower = (x + (0x80 - 'a') * ones) & ~(x + (0x7f - 'f') * ones);
    return is_zero(x & high) & is_zero(((digit | lower) & high) ^ high);
}

/* Which requests will not become spans under the policies (struct policy), decided by the
 * request scanner when the headers end (http_record.unspanned): AGG_UNSAMPLED for
 * exactly one traceparent that agent/enrich/traceparent.py parse() accepts, sampled flag clear;
 * AGG_NO_PARENT for no traceparent header at all; 0 (send it) for everything else. An invalid
 * value is sent too, so that its rejection is counted by reason, and so is anything the kernel
 * cannot be sure of: headers that did not end, or ran past the scan window (a second
 * traceparent could hide there). */
static __always_inline u8 unspanned(struct http_record *rec)
{
    int z = 0;
    struct policy *pol = policy.lookup(&z);
    if (!pol)
        return 0;
    u64 sure = is_zero((rec->flags & (REQF_HDR_DONE | REQF_TP_WINDOW)) ^ REQF_HDR_DONE);
    u64 count = rec->tp_count;
    u64 no_parent = sure & is_zero(count) & (1 ^ is_zero(pol->agg_no_parent));
    /* "vv-<32 hex trace id>-<16 hex parent id>-<2 hex flags>" (shared/TRACEPARENT.md) */
    const u8 *tp = (const u8 *)rec->tp;
    u64 len = rec->tp_len;
    u64 ok = sure & is_zero(count ^ 1) & (1 ^ is_zero(pol->agg_unsampled));
    ok &= 1 ^ ((len - 55) >> 63);                               /* >= 55 */
    ok &= is_zero((tp[2] ^ '-') | (tp[35] ^ '-') | (tp[52] ^ '-'));
    ok &= 1 ^ is_zero((tp[0] ^ 'f') | (tp[1] ^ 'f'));          /* version ff: invalid */
    /* version 00: exactly 55; a future one: the end or a '-' after the flags */
    u64 v00 = is_zero((tp[0] ^ '0') | (tp[1] ^ '0'));
    u64 ends = is_zero(len ^ 55);
    ok &= (v00 & ends) | ((v00 ^ 1) & (ends | is_zero(tp[55] ^ '-')));
    u64 t0, t1, t2, t3, p0, p1;
    __builtin_memcpy(&t0, &tp[3], 8);
    __builtin_memcpy(&t1, &tp[11], 8);
    __builtin_memcpy(&t2, &tp[19], 8);
    __builtin_memcpy(&t3, &tp[27], 8);
    __builtin_memcpy(&p0, &tp[36], 8);
    __builtin_memcpy(&p1, &tp[44], 8);
    /* version and flags, padded with '0's to a word */
    u64 vf = (u64)tp[0] | (u64)tp[1] << 8 | (u64)tp[53] << 16 | (u64)tp[54] << 24 |
             0x3030303000000000ULL;
    ok &= lhex8(t0) & lhex8(t1) & lhex8(t2) & lhex8(t3) & lhex8(p0) & lhex8(p1) & lhex8(vf);
    const u64 zeros = 0x3030303030303030ULL;    /* "00000000": an all-zero id is invalid */
    ok &= 1 ^ is_zero((t0 ^ zeros) | (t1 ^ zeros) | (t2 ^ zeros) | (t3 ^ zeros));
    ok &= 1 ^ is_zero((p0 ^ zeros) | (p1 ^ zeros));
    /* the sampled bit is the low bit of the flags' second digit's value */
    u64 last = tp[54];
    ok &= 1 ^ (((last & 0x0F) + ((last >> 6) & 1) * 9) & 1);
    return ok * AGG_UNSAMPLED + no_parent * AGG_NO_PARENT;
}

/* A request no span will be made of (the policies, or the budget shed it): counted and
 * aggregated per endpoint, never sent. */
static __always_inline void aggregate(struct http_record *rec, u16 why)
{
    struct agg_key k = {.pid = rec->pid, .lport = rec->lport, .why = why};
    u64 start = rec->arrival_ns && rec->arrival_ns <= rec->read_ns ? rec->arrival_ns : rec->read_ns;
    u64 ns = rec->end_ns > start ? rec->end_ns - start : 0;
    struct agg_val *v = shed.lookup(&k);
    if (!v) {
        struct agg_val fresh = {};
        shed.update(&k, &fresh);
        v = shed.lookup(&k);
        if (!v)
            return;
    }
    u32 b = bpf_log2l(ns / 1000 + 1);
    if (b >= AGG_BUCKETS)
        b = AGG_BUCKETS - 1;
    v->count++;
    v->sum_ns += ns;
    v->hist[b]++;
}

/* Records go out without waking the reader (it consumes on a timer, agent/pipeline/stages.py),
 * except every WAKE_EVERY-th on a CPU: then the ring can never be more than half full of records
 * nobody was woken for, and a burst still wakes the reader early. */
static __always_inline void send_record(struct http_record *rec)
{
    if (!budget_keeps(rec)) {
        count(CNT_SAMPLED_OUT_BUDGET);
        aggregate(rec, AGG_SHED);
        return;
    }
    u32 idx = CNT_RECORDS_SUBMITTED;
    u64 *n = counters.lookup(&idx);
    u64 flags = BPF_RB_NO_WAKEUP;
    if (n) {
        (*n)++;
        if (!(*n & (WAKE_EVERY - 1)))
            flags = BPF_RB_FORCE_WAKEUP;
    }
    if (events.ringbuf_output(rec, record_size(rec), flags) != 0)
        count(CNT_RINGBUF_FULL);
}

/* An HTTP/1.x request ends: kept in the kernel when no span will be made of it (decided when
 * its headers ended, http_request.h), else sent. HTTP/2 streams call send_record() directly:
 * the kernel does not decide for them, and h2_end has no verifier budget to spare. */
static __always_inline void emit(struct http_record *rec)
{
    u32 kept = (u32)rec->unspanned - AGG_UNSAMPLED;
    if (kept < 2) {
        count(CNT_UNSAMPLED_AGGREGATED + kept);     /* AGG_* and CNT_* in step */
        aggregate(rec, rec->unspanned);
        return;
    }
    send_record(rec);
}

/* What flush_conn hands its bpf_loop callback, on its stack */
struct flush_loop {
    u64 sk;
    u64 now;
    struct conn *c;
};

/* bpf_loop callback of flush_conn: emit and forget the oldest request still open. 1 (stop) when
 * none is left. */
int flush_conn_step(struct loop_arg a)
{
    struct flush_loop *l = a.ctx;
    struct conn *c = l->c;
    if (c->head >= c->tail)
        return 1;
    u64 seq = c->head;
    c->head = seq + 1;
    if (c->ghost_bits & (1ULL << (seq & 63)))
        return 0;                   /* untracked: already counted (pipeline_slots_full, lost) */
    struct http_record *rec = h1_record(l->sk, c, seq);
    h1_release(c, seq);
    if (!rec) {
        count(CNT_REQUEST_STATE_LOST);
        return 0;
    }
    if (rec->resp_start_ns) {
        rec->flags |= REQF_RESP_UNTERM;
        finish_request(rec, c, c->last_write_ns);
    } else {
        rec->flags |= REQF_NO_RESPONSE;
        finish_request(rec, c, l->now);
    }
    rec->status = c->rs_status;
    c->rs_status = 0;               /* a status belongs to the oldest open request only */
    emit(rec);
    rec->conn_id = 0;
    return 0;
}

/* Emit and forget every request still open on a connection that is going away. */
static __always_inline void flush_conn(u64 sk, struct conn *c, u64 now)
{
    struct flush_loop l = {.sk = sk, .now = now, .c = c};
    bpf_loop(OUTSTANDING_MAX, LOOP_CB(flush_conn_step), &l, 0);
    reset_parser(&c->rs, P_STATUS);
}

TRACEPOINT_PROBE(sock, inet_sock_set_state)
{
    if (args->protocol != IPPROTO_TCP_)
        return 0;
    u64 sk = (u64)args->skaddr;
    u64 now = bpf_ktime_get_ns();
    if (args->newstate == TCP_ESTABLISHED_) {
        /* made in map memory: on this program's stack it would leave too little for
         * flush_conn's bpf_loop callback (512 bytes for both frames) */
        int z = 0;
        struct conn *c = conn_new.lookup(&z);
        if (!c)
            return 0;
        __builtin_memset(c, 0, sizeof(*c));
        c->conn_id = new_conn_id();
        c->rs.state = P_STATUS;
        c->family = args->family;
        c->lport = args->sport;
        c->rport = args->dport;
        c->flags = CONN_TUPLE;
        if (args->family == AF_INET_) {
            __builtin_memcpy(c->laddr, args->saddr, 4);
            __builtin_memcpy(c->raddr, args->daddr, 4);
        } else {
            __builtin_memcpy(c->laddr, args->saddr_v6, 16);
            __builtin_memcpy(c->raddr, args->daddr_v6, 16);
        }
        if (args->oldstate == TCP_SYN_RECV_) {
            c->est_ns = now;           /* handshake done; the accept backlog wait starts */
#ifdef FILTER_PORT
            u16 port = args->sport;
            if (!filter_port.lookup(&port))
                c->flags |= CONN_IGNORED;
#endif
        } else {
            c->flags |= CONN_IGNORED;  /* a connection this host opened: a client, not served */
            u16 rport = args->dport;
            if (otlp_ports.lookup(&rport))  /* an exporter reaching a collector: the inspector
                                             * reads TCP tables again only after one */
                count(CNT_OTLP_CONNECTS);
        }
        conns.update(&sk, c);
        return 0;
    }
    /* We are closing (or the connection was reset): whatever is open has ended. The peer's FIN
     * alone (CLOSE_WAIT) does not end anything: a half-closed client still gets its response. */
    if (args->newstate == TCP_FIN_WAIT1_ || args->newstate == TCP_LAST_ACK_ ||
        args->newstate == TCP_CLOSE_) {
        struct conn *c = conns.lookup(&sk);
        if (c)
            flush_conn(sk, c, now);
        if (c && (c->flags & CONN_H2))
            h2_close(args, sk);     /* its streams (bpf/http2_conn.h) */
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
    struct req_key key = {.sk = sk, .seq = GHOST_SEQ};
    reqs.delete(&key);
#pragma unroll
    for (u32 i = 0; i < MAX_PENDING; i++) {
        if (c->slots_used & (1 << i)) {
            key.seq = h1_key_seq(i);
            reqs.delete(&key);
        }
    }
    conns.delete(&sk);
    h2conns.delete(&sk);
    return 0;
}

#ifdef WITH_TUPLE_AT_READ
static __always_inline void tuple_filled(struct conn *c)
{
    c->flags |= CONN_TUPLE;
#ifdef FILTER_PORT
    u16 port = c->lport;
    if (!filter_port.lookup(&port))
        c->flags |= CONN_IGNORED;
#endif
}

#ifdef SK_FAMILY_OFF
/* A connection first met at a read (older than the agent, or evicted from `conns`): its tuple,
 * and the port filter, read from the socket at the offsets the kernel's BTF gave (struct
 * sock_common, at the start of struct sock). sock_recv_length calls it for the state it makes:
 * no program runs at every TCP read of the host for the few connections that need it. */
static __always_inline void sk_tuple(u64 sk, struct conn *c)
{
    u16 family = 0, dport = 0;
    bpf_probe_read_kernel(&family, sizeof(family), (void *)(sk + SK_FAMILY_OFF));
    bpf_probe_read_kernel(&c->lport, sizeof(c->lport), (void *)(sk + SK_NUM_OFF));  /* host order */
    bpf_probe_read_kernel(&dport, sizeof(dport), (void *)(sk + SK_DPORT_OFF));      /* network */
    c->family = family;
    c->rport = __builtin_bswap16(dport);
    if (family == AF_INET_) {
        bpf_probe_read_kernel(c->laddr, 4, (void *)(sk + SK_RCV_SADDR_OFF));
        bpf_probe_read_kernel(c->raddr, 4, (void *)(sk + SK_DADDR_OFF));
    } else {
        bpf_probe_read_kernel(c->laddr, 16, (void *)(sk + SK_V6_RCV_SADDR_OFF));
        bpf_probe_read_kernel(c->raddr, 16, (void *)(sk + SK_V6_DADDR_OFF));
    }
    tuple_filled(c);
}
#else
/* Without the offsets: tcp_rcv_space_adjust, a classic tracepoint whose record carries the
 * tuple, fires inside every TCP read that copied data, before sock_recv_length. Only a read
 * the scanners would read, by a thread the pid/comm filters let through, creates state. */
TRACEPOINT_PROBE(tcp, tcp_rcv_space_adjust)
{
    u64 sk = (u64)args->skaddr;
    struct conn *c = conns.lookup(&sk);
    if (c && (c->flags & CONN_TUPLE))
        return 0;
    if (!c) {
        struct syscall_io io;
        if (syscall_io(&io) != DIR_RD)
            return 0;
        struct conn fresh = {};
        fresh.conn_id = new_conn_id();
        fresh.rs.state = P_STATUS;
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
    tuple_filled(c);
    return 0;
}
#endif
#endif

/* ---------------------------------------------------------------- socket data */

static __always_inline struct scratch *load_scratch(u64 sk, struct syscall_io *p, int ret)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    if (!s)
        return 0;
    s->sk = sk;
    s->now = bpf_ktime_get_ns();
    s->ptr = p->ptr;
    s->len = p->len;
    s->kind = p->kind;
    s->iov_idx = 0;
    s->iov_start = 0;
    s->total = ret;
    s->off = 0;
    s->fd = p->fd;
    s->chain = 0;
    s->base = 0;
    s->n = 0;                       /* windows are copied when a scanner needs bytes */
    s->walk_more = 0;
    s->h2_more = 0;
    return s;
}

static __always_inline int is_tcp(u16 family, u16 protocol)
{
    return (family == AF_INET_ || family == AF_INET6_) && protocol == IPPROTO_TCP_;
}

/* A classic tracepoint, as sock_send_length: both tail-call the scanners, which the syscall
 * exits (classic tracepoints) tail-call too, and a program array takes one program type. */
TRACEPOINT_PROBE(sock, sock_recv_length)
{
    if (args->ret <= 0 || !is_tcp(args->family, args->protocol) || (args->flags & MSG_PEEK_))
        return 0;
    u64 sk = (u64)args->sk;
    struct conn *c = conns.lookup(&sk);
    if (c && (c->flags & (CONN_IGNORED | CONN_UNTRUSTED)))
        return 0;               /* before the syscall's arguments are read: a client's reads */
    struct syscall_io io;
    if (syscall_io(&io) != DIR_RD)
        return 0;
    if (!c) {
        /* A connection from before we started (or evicted): its tuple from the socket
         * (sk_tuple; classic: tcp_rcv_space_adjust made the state already), or, without the
         * tuple at read, none: user space resolves it from the fd. */
        struct conn fresh = {};
        fresh.conn_id = new_conn_id();
        fresh.rs.state = P_STATUS;
#if defined(WITH_TUPLE_AT_READ) && defined(SK_FAMILY_OFF)
        sk_tuple(sk, &fresh);
#endif
#if defined(FILTER_PORT) && !defined(WITH_TUPLE_AT_READ)
        /* Its port is unknown here (no tuple at read), so the port filter cannot admit it: a
         * filter must never let another port through (docs/probes.md). */
        fresh.flags = CONN_IGNORED;
#endif
        conns.update(&sk, &fresh);
        c = conns.lookup(&sk);
        if (!c)
            return 0;
    }
    if (c->flags & (CONN_IGNORED | CONN_UNTRUSTED))
        return 0;
    struct scratch *s = load_scratch(sk, &io, args->ret);
    if (!s)
        return 0;
    /* this read takes the arrival; data arriving from now on is the next read's */
    s->arrival = c->arrival_ns <= s->now ? c->arrival_ns : 0;
    c->arrival_ns = 0;
    progs.call(args, (c->flags & CONN_H2) ? PROG_H2_RD : PROG_SCAN_REQ);
    if (c->flags & CONN_H2)
        h2_not_loaded(c);
    return 0;
}

TRACEPOINT_PROBE(sock, sock_send_length)
{
    if (args->ret <= 0 || !is_tcp(args->family, args->protocol))
        return 0;
    u64 sk = (u64)args->sk;
    struct conn *c = conns.lookup(&sk);
    if (!c || (c->flags & (CONN_IGNORED | CONN_RESP_LOST)))
        return 0;
    int h2 = c->flags & CONN_H2;        /* framed per stream by bpf/http2_scan.h */
    if (!h2 && c->head >= c->tail) {
        /* A response with no request open: the two directions disagree (a request we never
         * saw, or one response framed as two). Attributing anything further would be a guess. */
        if ((c->flags & (CONN_SEEN_REQ | CONN_UNTRUSTED)) == CONN_SEEN_REQ)
            untrust(c, CNT_UNTRUSTED_RESPONSE_WITHOUT_REQUEST);
        return 0;
    }
    struct syscall_io io = {}, none = {};
    if (syscall_io(&io) != DIR_WR)
        io = none;              /* not a write the scanners read (sendmmsg, splice): counted */
    struct scratch *s = load_scratch(sk, &io, args->ret);
    if (!s)
        return 0;
    c->last_write_ns = s->now;
    if (!h2 && c->rs.state == P_STATUS && c->rs.sub == 0)
        c->unacked_max = 0;     /* a response begins with this write: its own most in flight */
#if defined(WITH_TCPSTATS) && defined(TCP_SRTT_OFF)
    tcp_sample_at_write(sk, c);
#endif
#ifdef WITH_WORKSET
    if (!h2)
        ws_checkpoint(sk, c, s->now);   /* if this write ends the response, its record says so */
#endif
    progs.call(args, h2 ? PROG_H2_WR : PROG_SCAN_RESP);
    if (h2)
        h2_not_loaded(c);
    return 0;
}
