/* Enrichment: what the kernel did for a request while it was open, counted per thread
 * (scheduler, page faults, TLB) or per connection (TCP). Part of the bpf/http.c compile unit.
 *
 * Per-thread totals live in `threads`; a request snapshots them when it opens
 * (start_thread_stats) and takes the difference when it ends (finish_request).
 */

#if defined(TLB_HW) && !defined(WITH_SCHED)
#error "TLB_HW needs WITH_SCHED: the counters are read at every context switch of the thread"
#endif

#ifdef TLB_HW
/* The thread's hardware dTLB/iTLB load misses so far: completed on-CPU slices (added up at
 * each switch-out) plus the slice running now on this CPU. Call it in the thread itself. */
static __always_inline void tlb_hw_now(struct tstat *t, u64 *d, u64 *i)
{
    int cpu = bpf_get_smp_processor_id();
    u64 dn = dtlb.perf_read(cpu), in = itlb.perf_read(cpu);
    *d = t->tlb_a;
    *i = t->tlb_b;
    if ((s64)dn >= 0) {
        if (!t->hw_d_in)
            t->hw_d_in = dn;        /* first sight of the thread: its slice is counted from here */
        else if (dn >= t->hw_d_in)
            *d += dn - t->hw_d_in;
    }
    if ((s64)in >= 0) {
        if (!t->hw_i_in)
            t->hw_i_in = in;
        else if (in >= t->hw_i_in)
            *i += in - t->hw_i_in;
    }
}
#endif

/* Snapshot per-thread totals into the record as negatives; finish_request adds the totals at
 * the end, leaving the delta without a second copy of the baseline. Runs in the reading
 * thread. */
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
#ifdef TLB_HW
    u64 d = 0, i = 0;
    tlb_hw_now(t, &d, &i);          /* misses so far, the running slice included */
    rec->tlb_a = -d;
    rec->tlb_b = -i;
#else
    rec->tlb_a = -t->tlb_a;
    rec->tlb_b = -t->tlb_b;
#endif
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
#ifdef TLB_HW
    /* In the reading thread (the usual case: it writes the response), read the counters now;
     * from another thread, the reading thread's count as of its last switch-out. */
    u64 d = t->tlb_a, i = t->tlb_b;
    if ((u32)bpf_get_current_pid_tgid() == tid)
        tlb_hw_now(t, &d, &i);
    rec->tlb_a += d;
    rec->tlb_b += i;
#else
    rec->tlb_a += t->tlb_a;
    rec->tlb_b += t->tlb_b;
#endif
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
