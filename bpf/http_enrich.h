/* Enrichment: what the kernel did for a request while it was open, counted per thread
 * (scheduler, page faults, TLB) or per connection (TCP). Part of the bpf/http.c compile unit.
 *
 * Per-thread running totals live in `threads` (tstat.tot, by WSIG_*). With WITH_WORKSET a
 * request sums them over its work set (http_workset.h); without it, over the reading thread
 * only: start_thread_stats snapshots the totals when the request opens and finish_request takes
 * the difference when it ends.
 */

#if defined(TLB_HW) && !defined(WITH_SCHED)
#error "TLB_HW needs WITH_SCHED: the counters are read at every context switch of the thread"
#endif

#define TASK_REPORT_MAX_ 0x100  /* prev_state bit for "preempted" (R+); below it, the sleep states */

/* The scanners only note a request's opening and ending (a few stores, no branch: they are near
 * the verifier's limit); the thread's syscall exit does the work (run_notes, from syscall_exit() in
 * http_conn.h), in the same thread a few microseconds later. */
static __always_inline void note(struct scratch *s, u32 kind, u32 tid, u64 seq, u64 conn_id,
                                 u64 arg)
{
    u32 k = s->nnotes & (WS_NOTES - 1);
    s->notes[k].sk = s->sk;
    s->notes[k].seq = seq;
    s->notes[k].conn_id = conn_id;
    s->notes[k].arg = arg;
    s->notes[k].tid = tid;
    s->notes[k].kind = kind;
    s->nnotes = s->nnotes + 1;
}

/* A request was read (scan_req): its thread statistics start at the read's syscall exit. */
static __always_inline void start_thread_stats(struct scratch *s, struct http_record *rec)
{
    note(s, WS_NOTE_OPEN, rec->tid, req_map_seq(rec), rec->conn_id, rec->seq);
}

/* At the read's exit, in the reading thread: snapshot its totals into the record as negatives
 * (finish_request adds the totals at the end, leaving the delta without a second copy of the
 * baseline); with the work set, open the request's set instead. */
static __always_inline void open_request_stats(struct http_record *rec, u32 tid)
{
    u64 now = bpf_ktime_get_ns();
    struct tstat *t = thread_for(tid, 1, now);
    if (!t)
        return;
    t->runq_max = 0;
    rec->ws_flags |= WSF_STATS;
#ifdef WITH_WORKSET
    ws_open(rec, t, now);
#else
    rec->runq_ns = -t->tot[WSIG_RUNQ];
    rec->offcpu_ns = -t->tot[WSIG_OFFCPU];
#ifdef TLB_HW
    flush_tlb_hw(t);                /* misses so far, the running slice included */
#endif
    rec->tlb_a = -t->tot[WSIG_TLB_A];
    rec->tlb_b = -t->tot[WSIG_TLB_B];
    rec->minflt = -(u32)t->tot[WSIG_MINFLT];
    rec->majflt = -(u32)t->tot[WSIG_MAJFLT];
    rec->nr_switches = -(u32)t->tot[WSIG_SWITCHES];
#endif
}

/* The request ended at end_ns. Its record's work-set values are the checkpoint taken at the
 * start of its last response write (ws_checkpoint): the scanners and the close path are at the
 * verifier's limit, so the sums are never taken there. `noted`: the set ends at this syscall's
 * exit (run_notes); otherwise (a close) it is dropped now and its members let go of it at their
 * next scheduler event (ref_stale). A request that ended without any response write has no
 * work-set values (no WSF_TRACKED; counted as workset_lost). */
static __always_inline void finish_request_ws(struct http_record *rec, struct conn *c,
                                              u64 end_ns, int noted)
{
    rec->end_ns = end_ns;
    rec->retrans += c->retrans;
    rec->srtt_us = c->srtt_us;
    rec->unacked_max = c->unacked_max;
#ifdef WITH_WORKSET
    if (!noted) {
        struct ws_key key = {.conn_id = rec->conn_id, .seq = rec->seq};
        worksets.delete(&key);
        if (!(rec->ws_flags & WSF_TRACKED))
            count(CNT_WORKSET_LOST);
    }
#endif
    u32 tid = rec->tid;
    struct tstat *t = threads.lookup(&tid);
#ifndef WITH_WORKSET
    if (!t || !(rec->ws_flags & WSF_STATS)) {
        /* no baseline (the read's exit never ran it): no values, not absolute totals */
        rec->runq_ns = rec->offcpu_ns = rec->tlb_a = rec->tlb_b = 0;
        rec->minflt = rec->majflt = rec->nr_switches = 0;
        rec->ws_flags &= ~WSF_STATS;
        return;
    }
    rec->runq_ns += t->tot[WSIG_RUNQ];
    rec->offcpu_ns += t->tot[WSIG_OFFCPU];
#ifdef TLB_HW
    /* In the reading thread (the usual case: it writes the response), read the counters now;
     * from another thread, the reading thread's count as of its last switch-out. */
    if ((u32)bpf_get_current_pid_tgid() == tid)
        flush_tlb_hw(t);
#endif
    rec->tlb_a += t->tot[WSIG_TLB_A];
    rec->tlb_b += t->tot[WSIG_TLB_B];
    rec->minflt += (u32)t->tot[WSIG_MINFLT];
    rec->majflt += (u32)t->tot[WSIG_MAJFLT];
    rec->nr_switches += (u32)t->tot[WSIG_SWITCHES];
#else
    if (!t)
        return;
#endif
    /* the longest waits are the reading thread's (its runq_max was reset at the read) */
    rec->runq_max_ns = t->runq_max;
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

static __always_inline void finish_request(struct http_record *rec, struct conn *c, u64 end_ns)
{
    finish_request_ws(rec, c, end_ns, 0);
}

/* The response ended in scan_resp: the work-set values are the checkpoint taken when this write
 * began (ws_checkpoint); the set itself ends at the write's syscall exit. */
static __always_inline void finish_request_in_scanner(struct scratch *s, struct http_record *rec,
                                                      struct conn *c)
{
    finish_request_ws(rec, c, s->now, 1);
#ifdef WITH_WORKSET
    note(s, WS_NOTE_CLOSE, (u32)bpf_get_current_pid_tgid(), rec->seq, rec->conn_id, s->now);
#endif
}

/* At a syscall's exit: the notes this thread's scanners left (see note()). A note whose thread
 * migrated before its exit, or that four later ones overwrote, is not run: that request's
 * record then says its statistics were not taken (no WSF_STATS), and its work set, if any,
 * ends lazily. */
static __always_inline void run_notes_for(u32 tid)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    if (!s || !s->nnotes)
        return;
#pragma unroll 1
    for (int i = 0; i < WS_NOTES; i++) {
        struct ws_note *n = &s->notes[i];
        if (!n->kind || n->tid != tid)
            continue;
        if (n->kind == WS_NOTE_OPEN) {
            struct req_key key = {.sk = n->sk, .seq = n->seq};    /* req_map_seq */
            struct http_record *rec = reqs.lookup(&key);
            if (rec && rec->conn_id == n->conn_id && rec->seq == n->arg)
                open_request_stats(rec, tid);
        }
#ifdef WITH_WORKSET
        else {
            ws_close(n->conn_id, n->seq, n->arg);
        }
#endif
        n->kind = 0;
    }
    /* Another thread's notes stay (counted after the loop: a count carried through it would
     * make the verifier walk each iteration once per value of it) */
    u32 left = 0;
#pragma unroll
    for (int i = 0; i < WS_NOTES; i++)
        left |= s->notes[i].kind;
    if (!left)
        s->nnotes = 0;
}

/* Bytes of the record to send: the members it does not use are left out (they are most of a
 * record's size, and most requests have no helper). */
static __always_inline u32 record_size(struct http_record *rec)
{
    if (rec->ws_flags & WSF_CUDA)
        return sizeof(*rec);    /* the CUDA sums are at the end */
    u32 n = rec->ws_nslots;
    if (n > WS_SLOTS)
        n = WS_SLOTS;
    return REC_HTTP_FIXED_SIZE + n * sizeof(struct ws_member);
}

static __always_inline void note_runq_wait(struct tstat *t, u64 start, u64 now)
{
    u64 d = now - start;
    acct(t, WSIG_RUNQ, d);
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
/* prev (the current thread) switches out, runnable or going to sleep; next switches in. */
static __always_inline int on_switch(u32 prev, u32 next, int runnable)
{
    /* most switches on a host: neither thread was ever tracked, and no clock is read */
    struct tstat *t = thread_of(prev), *tn = thread_of(next);
    u64 now = 0;
    if (t) {
        now = bpf_ktime_get_ns();
        flush_oncpu(t, now);
        t->oncpu_ts = 0;
        t->tgid = bpf_get_current_pid_tgid() >> 32;     /* prev is still current here */
        acct(t, WSIG_SWITCHES, 1);
        if (runnable) {
            t->queued_ts = now;         /* runnable (preempted, or yielded): still queued */
        } else {
            t->sleep_ts = now;
            if (!t->asleep) {
                t->asleep = 1;
#ifdef WITH_WORKSET
                if (t->nopen)
                    ws_blocked(t, 1, now);
#endif
            }
        }
#ifdef TLB_HW
        int cpu = bpf_get_smp_processor_id();
        u64 d = dtlb.perf_read(cpu), ii = itlb.perf_read(cpu);
        if ((s64)d >= 0 && t->hw_d_in && d >= t->hw_d_in)
            acct(t, WSIG_TLB_A, d - t->hw_d_in);
        if ((s64)ii >= 0 && t->hw_i_in && ii >= t->hw_i_in)
            acct(t, WSIG_TLB_B, ii - t->hw_i_in);
#endif
    }
    t = tn;
    if (t) {
        if (!now)
            now = bpf_ktime_get_ns();
        if (t->queued_ts) {
            note_runq_wait(t, t->queued_ts, now);
            t->queued_ts = 0;
        } else if (t->wake_ts) {
            note_runq_wait(t, t->wake_ts, now);
            t->wake_ts = 0;
        }
        t->oncpu_ts = now;
#ifdef TLB_HW
        int cpu = bpf_get_smp_processor_id();
        t->hw_d_in = dtlb.perf_read(cpu);
        t->hw_i_in = itlb.perf_read(cpu);
#endif
    }
    return 0;
}

#ifdef TASK_PID_OFF
/* Raw tracepoints where the kernel's BTF gave task_struct's pid offset: the program gets the
 * tracepoint's own arguments, without the perf trace record a TRACEPOINT_PROBE has filled
 * first (both comms, for sched_switch). These fire for every thread on the host, so that
 * record was most of what an untracked thread's switch or wake-up cost
 * (docs/performance.md). */

/* TP_PROTO(bool preempt, struct task_struct *prev, struct task_struct *next,
 *          unsigned int prev_state) (5.18 on): prev stays runnable when preempted, or when it
 * switched out in state TASK_RUNNING (a yield); any other state is a sleep. */
RAW_TRACEPOINT_PROBE(sched_switch)
{
    int runnable = (u8)ctx->args[0] || (u32)ctx->args[3] == 0;
    return on_switch((u32)bpf_get_current_pid_tgid(), kernel_u32(ctx->args[2] + TASK_PID_OFF),
                     runnable);
}
#else
TRACEPOINT_PROBE(sched, sched_switch)
{
    /* prev_state here is the tracepoint's: TASK_REPORT_MAX when preempted, else a sleep
     * state's bit, 0 for a yield */
    return on_switch(args->prev_pid, args->next_pid,
                     (args->prev_state & (TASK_REPORT_MAX_ - 1)) == 0);
}
#endif

static __always_inline int on_wakeup(u32 pid)
{
    struct tstat *t = thread_of(pid);
    if (!t)
        return 0;
    u64 now = bpf_ktime_get_ns();
    if (t->sleep_ts) {
        acct(t, WSIG_OFFCPU, now - t->sleep_ts);
        t->sleep_ts = 0;
    }
    t->wake_ts = now;
    if (t->asleep) {
        t->asleep = 0;
#ifdef WITH_WORKSET
        if (t->nopen)
            ws_blocked(t, 0, now);
#endif
    }
    return 0;
}

#ifdef TASK_PID_OFF
RAW_TRACEPOINT_PROBE(sched_wakeup)     /* TP_PROTO(struct task_struct *p) */
{
    return on_wakeup(kernel_u32(ctx->args[0] + TASK_PID_OFF));
}
#else
TRACEPOINT_PROBE(sched, sched_wakeup) { return on_wakeup(args->pid); }
#endif
/* a classic tracepoint: the work set's raw program has the raw one (http_workset.h) */
TRACEPOINT_PROBE(sched, sched_wakeup_new) { return on_wakeup(args->pid); }
#endif

#ifdef WITH_FAULTS
/* Software perf events (sample_period 1) run in the faulting thread and tell minor from major,
 * which the exceptions:page_fault_user tracepoint (fired before the fault is handled) cannot. */
int on_minflt(struct bpf_perf_event_data *ctx)
{
    struct tstat *t = thread_of((u32)bpf_get_current_pid_tgid());
    if (t)
        acct(t, WSIG_MINFLT, 1);
    return 0;
}

int on_majflt(struct bpf_perf_event_data *ctx)
{
    struct tstat *t = thread_of((u32)bpf_get_current_pid_tgid());
    if (t)
        acct(t, WSIG_MAJFLT, 1);
    return 0;
}
#endif

#if defined(WITH_TLB_FLUSH) && !defined(TLB_HW)
/* Fallback without a PMU: TLB *flushes* involving this thread, not misses (see docs/attributes.md). */
RAW_TRACEPOINT_PROBE(tlb_flush)     /* TP_PROTO(int reason, unsigned long pages) */
{
    struct tstat *t = thread_of((u32)bpf_get_current_pid_tgid());
    if (t) {
        acct(t, WSIG_TLB_A, 1);
        if (ctx->args[1] == (u64)-1)   /* a full flush */
            acct(t, WSIG_TLB_B, 1);
    }
    return 0;
}
#endif

#ifdef WITH_RECVQ
/* Every socket's data arrival on the host: a raw tracepoint, TP_PROTO(const struct sock *sk),
 * so no perf trace record is filled for the sockets that are not ours. */
RAW_TRACEPOINT_PROBE(sk_data_ready)
{
    u64 sk = ctx->args[0];
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

static __always_inline void tcp_sample(struct conn *c, u32 srtt_us, u32 snd_nxt, u32 snd_una)
{
    c->srtt_us = srtt_us;
    u32 inflight = snd_nxt - snd_una;
    if (inflight > c->unacked_max)
        c->unacked_max = inflight;
}

#ifdef TCP_SRTT_OFF
/* At each write of a served connection (sock_send_length, after the write queued its bytes):
 * tcp_sock's fields, at the offsets the kernel's BTF gave. No program runs at the host's
 * segments; srtt_us is kept <<3, as the classic tracepoint's srtt undoes. */
static __always_inline void tcp_sample_at_write(u64 sk, struct conn *c)
{
    tcp_sample(c, kernel_u32(sk + TCP_SRTT_OFF) >> 3, kernel_u32(sk + TCP_SND_NXT_OFF),
               kernel_u32(sk + TCP_SND_UNA_OFF));
}
#else
/* Without the offsets: every TCP segment received on the host, with tcp_sock's fields in its
 * perf trace record. */
TRACEPOINT_PROBE(tcp, tcp_probe)
{
    u64 sk = (u64)args->skaddr;
    struct conn *c = conns.lookup(&sk);
    if (c && !(c->flags & CONN_IGNORED))
        tcp_sample(c, args->srtt, args->snd_nxt, args->snd_una);
    return 0;
}
#endif
#endif

/* Tail call PROG_RUN_NOTES from a probed syscall's exit (syscall_exit() in http_conn.h): verified once,
 * not in each exit program. */
int run_notes(void *ctx)
{
    run_notes_for((u32)bpf_get_current_pid_tgid());
    return 0;
}
