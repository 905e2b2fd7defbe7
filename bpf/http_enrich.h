/* Enrichment: what the kernel did for a request while it was open, counted per thread
 * (scheduler, page faults, TLB) or per connection (TCP). Part of the bpf/http.c compile unit.
 *
 * Per-thread running totals live in `threads` (tstat.tot, by WSIG_*). With WITH_WORKSET a
 * request sums them over its work set (http_workset.h); without it, over the reading thread
 * only: start_thread_stats snapshots the totals when the request opens and finish_request takes
 * the difference when it ends.
 */

#define TASK_REPORT_MAX_ 0x100  /* prev_state bit for "preempted" (R+); below it, the sleep states */

/* Snapshot per-thread totals into the record as negatives; finish_request adds the totals at
 * the end, leaving the delta without a second copy of the baseline. */
static __always_inline void start_thread_stats(struct http_record *rec, u32 tid)
{
    u64 now = bpf_ktime_get_ns();
    struct tstat *t = thread_for(tid, 1, now);
    if (!t)
        return;
    t->runq_max = 0;
#ifdef WITH_WORKSET
    ws_open(rec, t, now);
#else
    rec->runq_ns = -t->tot[WSIG_RUNQ];
    rec->offcpu_ns = -t->tot[WSIG_OFFCPU];
    rec->tlb_a = -t->tot[WSIG_TLB_A];
    rec->tlb_b = -t->tot[WSIG_TLB_B];
    rec->minflt = -(u32)t->tot[WSIG_MINFLT];
    rec->majflt = -(u32)t->tot[WSIG_MAJFLT];
    rec->nr_switches = -(u32)t->tot[WSIG_SWITCHES];
#endif
}

static __always_inline void finish_request(struct http_record *rec, struct conn *c, u64 end_ns)
{
    rec->end_ns = end_ns;
    rec->retrans += c->retrans;
    rec->srtt_us = c->srtt_us;
    rec->unacked_max = c->unacked_max;
#ifdef WITH_WORKSET
    ws_finish(rec, end_ns);
#endif
    u32 tid = rec->tid;
    struct tstat *t = threads.lookup(&tid);
    if (!t) {
#ifndef WITH_WORKSET
        rec->runq_ns = rec->offcpu_ns = rec->tlb_a = rec->tlb_b = 0;
        rec->minflt = rec->majflt = rec->nr_switches = 0;
#endif
        return;
    }
#ifndef WITH_WORKSET
    rec->runq_ns += t->tot[WSIG_RUNQ];
    rec->offcpu_ns += t->tot[WSIG_OFFCPU];
    rec->tlb_a += t->tot[WSIG_TLB_A];
    rec->tlb_b += t->tot[WSIG_TLB_B];
    rec->minflt += (u32)t->tot[WSIG_MINFLT];
    rec->majflt += (u32)t->tot[WSIG_MAJFLT];
    rec->nr_switches += (u32)t->tot[WSIG_SWITCHES];
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


/* Bytes of the record to send: the members it does not use are left out (they are most of a
 * record's size, and most requests have no helper). */
static __always_inline u32 record_size(struct http_record *rec)
{
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
TRACEPOINT_PROBE(sched, sched_switch)
{
    u64 now = bpf_ktime_get_ns();
    u32 prev = args->prev_pid, next = args->next_pid;
    struct tstat *t = threads.lookup(&prev);
    if (t) {
        flush_oncpu(t, now);
        t->oncpu_ts = 0;
        t->tgid = bpf_get_current_pid_tgid() >> 32;     /* prev is still current here */
        acct(t, WSIG_SWITCHES, 1);
        if ((args->prev_state & (TASK_REPORT_MAX_ - 1)) == 0) {
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
    t = threads.lookup(&next);
    if (t) {
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

static __always_inline int on_wakeup(u32 pid)
{
    struct tstat *t = threads.lookup(&pid);
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
        acct(t, WSIG_MINFLT, 1);
    return 0;
}

int on_majflt(struct bpf_perf_event_data *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct tstat *t = threads.lookup(&tid);
    if (t)
        acct(t, WSIG_MAJFLT, 1);
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
        acct(t, WSIG_TLB_A, 1);
        if (args->pages == (unsigned long)-1)
            acct(t, WSIG_TLB_B, 1);
    }
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
