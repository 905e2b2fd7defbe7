/* The work set of a request (docs/attributes.md "Work set", DESIGN principle 5): the thread that
 * read it, plus every thread a member wakes while the request is open, until that thread wakes
 * the reader back (the reply) or the response ends. Part of the bpf/http.c compile unit.
 *
 * sched:sched_waking runs in the waker's context, so futex, condition variable, pipe, eventfd,
 * unix socket and loopback TCP hand-offs all name who handed work to whom; sched_wakeup_new
 * does the same for a thread or process a member creates. Both are attached as raw tracepoints
 * for the woken task's flags and process, at offsets from the running kernel's BTF.
 *
 * Cost: every sched and fault program starts with one `threads` lookup, and a thread in no open
 * work set (nopen == 0) stops there. Per event a thread only adds to its own running totals
 * (tstat.tot, .sh, .appt); a request takes their differences when a member joins and leaves. The
 * on-CPU slice is re-based only when the count of open requests on the thread changes
 * (flush_oncpu), so an event costs O(1) however many requests share the thread.
 *
 * Shared threads: while a thread works for more than one open request (an event loop, a batching
 * worker, a GIL hand-off between two handlers) everything it does is counted in tstat.sh too. A
 * request's own values are its members' totals less their shared parts; the shared parts are
 * reported apart (http_record.shared), never as the request's own.
 */

/* ---------------------------------------------------------------- per-thread accounting */

static __always_inline void acct(struct tstat *t, u32 sig, u64 v)
{
    u32 k = sig & (WSIG_COUNT - 1);
    t->tot[k] += v;
    if (t->nopen > 1)
        t->sh[k] += v;
}

/* Close the thread's running on-CPU slice at `now` under its current open-request count. */
static __always_inline void flush_oncpu(struct tstat *t, u64 now)
{
    u64 since = t->oncpu_ts;
    if (!since || now <= since)
        return;
    u64 d = now - since;
    t->oncpu_ts = now;
    acct(t, WSIG_ONCPU, d);
    u32 n = t->nopen;
    if (n > 1)
        t->appt += d / n;
}

#ifdef TLB_HW
/* In the thread itself: add the hardware dTLB/iTLB misses of its running on-CPU slice and
 * restart the slice here (sched_switch adds the completed slices). */
static __always_inline void flush_tlb_hw(struct tstat *t)
{
    int cpu = bpf_get_smp_processor_id();
    u64 dn = dtlb.perf_read(cpu), in = itlb.perf_read(cpu);
    if ((s64)dn >= 0) {
        if (t->hw_d_in && dn >= t->hw_d_in)
            acct(t, WSIG_TLB_A, dn - t->hw_d_in);
        t->hw_d_in = dn;            /* first sight of the thread: its slice is counted from here */
    }
    if ((s64)in >= 0) {
        if (t->hw_i_in && in >= t->hw_i_in)
            acct(t, WSIG_TLB_B, in - t->hw_i_in);
        t->hw_i_in = in;
    }
}
#endif

/* Bit tid of known_tids is set before `threads` first gets an entry for tid, and never
 * cleared: a clear bit means no entry. The programs that run for every thread on the host
 * (scheduler, faults, TLB) ask thread_of(), so a thread the agent never tracked costs them one
 * array read instead of a hash lookup that misses. One bit per possible thread id
 * (PID_MAX_LIMIT, 4M): 512 KiB. Bits of tracked threads that exited stay set; the lookup
 * behind them then misses, as every lookup did before. */
#define TID_WORDS (4194304 / 64)
BPF_ARRAY(known_tids, u64, TID_WORDS);

/* The word of known_tids that holds tid's bit (1ULL << (tid & 63)). */
static __always_inline u64 *tid_word(u32 tid)
{
    u32 w = tid / 64;
    return known_tids.lookup(&w);
}

static __always_inline struct tstat *thread_of(u32 tid)
{
    u64 *bits = tid_word(tid);
    if (!bits || !(*bits & (1ULL << (tid & 63))))
        return 0;
    return threads.lookup(&tid);
}

/* The thread's totals, created zeroed when missing. `running`: it is the current thread, so its
 * on-CPU slice starts now; otherwise it is being woken (it sleeps until sched_wakeup says not). */
static __always_inline struct tstat *thread_for(u32 tid, int running, u64 now)
{
    struct tstat *t = threads.lookup(&tid);
    if (t)
        return t;
    int z = 0;
    struct tstat *zero = zero_thread.lookup(&z);
    if (!zero)
        return 0;
    u64 *bits = tid_word(tid);
    if (!bits)
        return 0;
    __sync_fetch_and_or(bits, 1ULL << (tid & 63));
    threads.insert(&tid, zero);
    t = threads.lookup(&tid);
    if (!t)
        return 0;
    if (running) {
        t->oncpu_ts = now;
        t->tgid = bpf_get_current_pid_tgid() >> 32;
    } else {
        t->asleep = 1;
    }
    return t;
}

#ifdef WITH_WORKSET
/* ---------------------------------------------------------------- work sets */

#define WS_NO_SLOT 0xff
#define REF_REPLIED 0x80000000  /* ws_ref.idx: the thread left the set by waking its reader */
#define PF_KTHREAD_ 0x00200000  /* task_struct.flags: a kernel thread */
#define NET_TX_SOFTIRQ_ 2
#define NET_RX_SOFTIRQ_ 3

struct ws_key {
    u64 conn_id;
    u64 seq;
};

/* A member, with its totals when it (last) joined. */
struct ws_mem {
    u32 tid;
    u32 pid;                    /* its process; 0 until the thread has been seen running */
    u8 left;                    /* woke the reader (replied), or the response ended */
    u8 slot;                    /* index in slots[]; WS_NO_SLOT for the reader and the unslotted */
    u8 reffed;                  /* the thread holds a ws_ref to this set */
    u8 _pad[5];
    u64 base_tot[WSIG_COUNT];
    u64 base_sh[WSIG_COUNT];
    u64 base_appt;
};

struct workset {
    u32 n;                      /* members in m[], the reader first */
    u32 pid;                    /* the reader's process and ... */
    u32 fd;                     /* ... the connection's fd in it */
    u32 helpers_awake;          /* members other than the reader that are not blocked */
    u32 reader_blocked;
    u16 shared_max;
    u16 unslotted;
    u16 refused;
    u8 nslots;
    u8 flags;                   /* WSF_* */
    u32 _pad;
    u64 gap_ts;                 /* reader blocked and no helper awake since; 0: not now */
    u64 unexplained;
    u64 tot[WSIG_COUNT];        /* differences of members that have left, summed */
    u64 sh[WSIG_COUNT];
    u64 appt;
    u64 helper_oncpu;           /* own on-CPU of members other than the reader */
    struct ws_member slots[WS_SLOTS];
    struct ws_mem m[WS_MAX];
};

/* Kernel-private to the work set, so declared here rather than in http.c. */
BPF_TABLE("lru_hash", struct ws_key, struct workset, worksets, WS_ENTRIES);
BPF_PERCPU_ARRAY(zero_ws, struct workset, 1);           /* never written: a zeroed template */
/* [0]: the agent's process id, set by user space before any program attaches (a map, not a
 * define: the compiled programs are kept and loaded by later starts, agent/kernel/compiled.py) */
BPF_ARRAY(agent_tgid, u32, 1);
/* CUDA calls, summed per work set (they need the maps above) */
#ifdef WITH_CUDA
#include "cuda.h"
#endif

/* The unexplained wait: the reader is blocked and no other member is runnable. Re-evaluated at
 * each change of either, so it costs O(1) per transition. */
static __always_inline void ws_gap(struct workset *ws, u64 now)
{
    int open = ws->reader_blocked && ws->helpers_awake == 0;
    if (open && !ws->gap_ts) {
        ws->gap_ts = now;
    } else if (!open && ws->gap_ts) {
        if (now > ws->gap_ts)
            ws->unexplained += now - ws->gap_ts;
        ws->gap_ts = 0;
    }
}

static __always_inline int ref_add(struct tstat *t, struct ws_key *key, u32 idx)
{
#pragma unroll
    for (int r = 0; r < WS_REFS; r++) {
        if (t->refs[r].conn_id == key->conn_id && t->refs[r].seq == key->seq) {
            if (t->refs[r].idx & REF_REPLIED && t->nreplied)
                t->nreplied--;  /* it had replied: it works for the set again */
            t->refs[r].idx = idx;
            return 1;
        }
    }
#pragma unroll
    for (int r = 0; r < WS_REFS; r++) {
        if (t->refs[r].conn_id == 0) {
            t->refs[r].conn_id = key->conn_id;
            t->refs[r].seq = key->seq;
            t->refs[r].idx = idx;
            return 1;
        }
    }
    count(CNT_WORKSET_REFS_FULL);
    return 0;
}

static __always_inline void ref_drop(struct tstat *t, struct ws_key *key)
{
#pragma unroll
    for (int r = 0; r < WS_REFS; r++)
        if (t->refs[r].conn_id == key->conn_id && t->refs[r].seq == key->seq)
            t->refs[r].conn_id = 0;
}

/* A set in t's references that no longer exists ended without reaching t (evicted, or its
 * request's state was lost): t no longer works for it. */
static __always_inline void ref_stale(struct tstat *t, int r, u64 now)
{
    struct ws_ref *ref = &t->refs[r & (WS_REFS - 1)];
    ref->conn_id = 0;
    if (ref->idx & REF_REPLIED) {
        if (t->nreplied)
            t->nreplied--;
    } else if (t->nopen) {
        flush_oncpu(t, now);
        t->nopen--;
    }
}

/* t's open-request count just rose: every set it is in now shares it with nopen - 1 others. */
static __always_inline void ws_note_sharing(struct tstat *t, struct workset *self)
{
    u32 others = t->nopen - 1;
    if (others > 0xffff)
        others = 0xffff;
    if (self->shared_max < others)
        self->shared_max = others;
    if (!others)
        return;
#pragma unroll
    for (int r = 0; r < WS_REFS; r++) {
        struct ws_key k = {.conn_id = t->refs[r].conn_id, .seq = t->refs[r].seq};
        if (!k.conn_id || (t->refs[r].idx & REF_REPLIED))
            continue;
        struct workset *o = worksets.lookup(&k);
        if (o && o->shared_max < others)
            o->shared_max = others;
    }
}

/* Member i (thread t) starts working for the set: take its totals as the base. */
static __always_inline void ws_begin(struct workset *ws, struct ws_key *key, u32 i,
                                     struct tstat *t, u64 now)
{
    struct ws_mem *m = &ws->m[i & (WS_MAX - 1)];
    flush_oncpu(t, now);        /* the slice so far belongs to the old count */
#ifdef TLB_HW
    if ((u32)bpf_get_current_pid_tgid() == m->tid)
        flush_tlb_hw(t);
#endif
    if (t->sleep_ts && now > t->sleep_ts) {
        /* the sleep it is being woken from began before it worked for the set: not the set's */
        acct(t, WSIG_OFFCPU, now - t->sleep_ts);
        t->sleep_ts = now;
    }
    t->nopen++;
    m->left = 0;
    if (!m->pid)
        m->pid = t->tgid;
#pragma unroll
    for (int s = 0; s < WSIG_COUNT; s++) {
        m->base_tot[s] = t->tot[s];
        m->base_sh[s] = t->sh[s];
    }
    m->base_appt = t->appt;
    if (i == 0)
        t->reading++;
    m->reffed = ref_add(t, key, i);
    ws_note_sharing(t, ws);
    if (i != 0 && m->reffed && !t->asleep) {
        ws->helpers_awake++;
        ws_gap(ws, now);
    }
}

/* A new member: thread `tid` (totals t). The first one is the reader. */
static __always_inline void ws_add(struct workset *ws, struct ws_key *key, u32 tid,
                                   struct tstat *t, const char *comm, u64 now)
{
    u32 n = ws->n;
    if (n >= WS_MAX) {
        ws->refused++;
        ws->flags |= WSF_CAP;
        count(CNT_WORKSET_FULL);
        return;
    }
    struct ws_mem *m = &ws->m[n & (WS_MAX - 1)];
    m->tid = tid;
    m->pid = t->tgid;
    m->slot = WS_NO_SLOT;
    if (n > 0) {
        u32 s = ws->nslots;
        if (s < WS_SLOTS) {
            struct ws_member *o = &ws->slots[s & (WS_SLOTS - 1)];
            o->tid = tid;
            o->join_ns = now;
            if (comm)
                __builtin_memcpy(o->comm, comm, sizeof(o->comm));
            m->slot = s;
            ws->nslots = s + 1;
        } else {
            ws->unslotted++;
        }
    }
    ws->n = n + 1;
    ws_begin(ws, key, n, t, now);
}

/* What member m's thread did for the set alone since it joined: its total less the shared part. */
static __always_inline u64 own_delta(struct tstat *t, struct ws_mem *m, u32 sig)
{
    u32 k = sig & (WSIG_COUNT - 1);
    return (t->tot[k] - m->base_tot[k]) - (t->sh[k] - m->base_sh[k]);
}

/* Member i stops working for the set at `now`: add what it did since it joined. t may be gone
 * (evicted), and then what it did is lost, not guessed. */
static __always_inline void ws_end(struct workset *ws, struct ws_key *key, u32 i,
                                   struct tstat *t, u64 now)
{
    struct ws_mem *m = &ws->m[i & (WS_MAX - 1)];
    if (m->left)
        return;
    m->left = 1;
    if (!t)
        return;
    flush_oncpu(t, now);
#ifdef TLB_HW
    if ((u32)bpf_get_current_pid_tgid() == m->tid)
        flush_tlb_hw(t);        /* else: its misses as of its last switch-out */
#endif
    if (!m->pid)
        m->pid = t->tgid;
#pragma unroll
    for (int s = 0; s < WSIG_COUNT; s++) {
        ws->tot[s] += t->tot[s] - m->base_tot[s];
        ws->sh[s] += t->sh[s] - m->base_sh[s];
    }
    ws->appt += t->appt - m->base_appt;
    u64 oncpu = t->tot[WSIG_ONCPU] - m->base_tot[WSIG_ONCPU];
    u64 oncpu_sh = t->sh[WSIG_ONCPU] - m->base_sh[WSIG_ONCPU];
    if (i != 0)
        ws->helper_oncpu += oncpu - oncpu_sh;
    u32 slot = m->slot;
    if (slot < WS_SLOTS) {
        struct ws_member *o = &ws->slots[slot & (WS_SLOTS - 1)];
        o->pid = m->pid;
        o->leave_ns = now;
        o->oncpu_ns += oncpu - oncpu_sh;
        o->shared_oncpu_ns += oncpu_sh;
        o->runq_ns += own_delta(t, m, WSIG_RUNQ);
        o->minflt += own_delta(t, m, WSIG_MINFLT);
        o->majflt += own_delta(t, m, WSIG_MAJFLT);
        o->tlb_a += own_delta(t, m, WSIG_TLB_A);
        o->tlb_b += own_delta(t, m, WSIG_TLB_B);
    }
    if (m->reffed) {
        ref_drop(t, key);
        m->reffed = 0;
        if (i != 0 && !t->asleep && ws->helpers_awake) {
            ws->helpers_awake--;
            ws_gap(ws, now);
        }
    }
    if (i == 0 && t->reading)
        t->reading--;
    if (t->nopen)
        t->nopen--;
}

static __always_inline int ws_find(struct workset *ws, u32 tid)
{
    int found = -1;
    u32 n = ws->n;
#pragma unroll
    for (int k = 0; k < WS_MAX; k++)
        if (k < n && ws->m[k].tid == tid)
            found = k;
    return found;
}

/* The request was read by the current thread (totals t): open its set with the reader. */
static __always_inline void ws_open(struct http_record *rec, struct tstat *t, u64 now)
{
    struct ws_key key = {.conn_id = rec->conn_id, .seq = rec->seq};
    int z = 0;
    struct workset *zero = zero_ws.lookup(&z);
    if (!key.conn_id || !zero)
        return;
    if (worksets.update(&key, zero) != 0)
        return;                 /* counted as lost when the response ends */
    struct workset *ws = worksets.lookup(&key);
    if (!ws)
        return;
    ws->pid = rec->pid;
    ws->fd = rec->fd;
    t->tgid = rec->pid;
    ws_add(ws, &key, rec->tid, t, 0, now);
    if (!ws->m[0].reffed)
        ws->flags |= WSF_NO_GAP;
}

/* Add v to the record's own value of signal sig (a constant once the callers' loops unroll). */
static __always_inline void rec_own(struct http_record *rec, u32 sig, u64 v)
{
    if (sig == WSIG_ONCPU)
        rec->oncpu_ns += v;
    else if (sig == WSIG_RUNQ)
        rec->runq_ns += v;
    else if (sig == WSIG_OFFCPU)
        rec->offcpu_ns += v;
    else if (sig == WSIG_MINFLT)
        rec->minflt += v;
    else if (sig == WSIG_MAJFLT)
        rec->majflt += v;
    else if (sig == WSIG_TLB_A)
        rec->tlb_a += v;
    else if (sig == WSIG_TLB_B)
        rec->tlb_b += v;
    else
        rec->nr_switches += v;
}

/* The work set's values as of `now`, written into the record (overwriting any earlier ones):
 * what the members that left added, plus what each member still in the set did since it
 * joined. Nobody leaves here, so it can run at every response write (ws_checkpoint). */
static __always_inline void ws_snapshot(struct http_record *rec, u64 now)
{
    struct ws_key key = {.conn_id = rec->conn_id, .seq = rec->seq};
    struct workset *ws = worksets.lookup(&key);
    if (!ws)
        return;
    rec->oncpu_ns = rec->runq_ns = rec->offcpu_ns = rec->tlb_a = rec->tlb_b = 0;
    rec->minflt = rec->majflt = rec->nr_switches = 0;
#pragma unroll
    for (int s = 0; s < WSIG_COUNT; s++) {
        rec->shared[s] = ws->sh[s];
        rec_own(rec, s, ws->tot[s] - ws->sh[s]);
    }
    rec->helper_oncpu_ns = ws->helper_oncpu;
    rec->shared_apportioned_ns = ws->appt;
    __builtin_memcpy(rec->members, ws->slots, sizeof(rec->members));
    u32 procs = 0;
    /* A real bounded loop, not unrolled: eight inlined copies would not fit the BPF stack. */
#pragma clang loop unroll(disable)
    for (u32 i = 0; i < WS_MAX; i++) {
        if (i >= *(volatile u32 *)&ws->n)  /* re-read, so the bound the verifier sees is WS_MAX */
            break;
        struct ws_mem *m = &ws->m[i & (WS_MAX - 1)];
        u32 tid = m->tid;
        struct tstat *t = m->left ? 0 : threads.lookup(&tid);
        if (t && !m->pid)
            m->pid = t->tgid;
        u32 p = m->pid;
        int first = p != 0;
#pragma unroll
        for (u32 k = 0; k < WS_MAX; k++)
            if (k < i && ws->m[k].pid == p)
                first = 0;
        procs += first;
        if (!t)
            continue;
        flush_oncpu(t, now);
#ifdef TLB_HW
        if ((u32)bpf_get_current_pid_tgid() == tid)
            flush_tlb_hw(t);
#endif
#pragma unroll
        for (int s = 0; s < WSIG_COUNT; s++) {
            u64 d = t->tot[s] - m->base_tot[s];
            u64 dsh = t->sh[s] - m->base_sh[s];
            if (dsh > d)        /* a racing update on another CPU: never a negative own part */
                dsh = d;
            rec->shared[s] += dsh;
            rec_own(rec, s, d - dsh);
        }
        rec->shared_apportioned_ns += t->appt - m->base_appt;
        u64 oncpu = own_delta(t, m, WSIG_ONCPU);
        if (i != 0)
            rec->helper_oncpu_ns += oncpu;
        u32 slot = m->slot;
        if (slot < WS_SLOTS) {
            struct ws_member *o = &rec->members[slot & (WS_SLOTS - 1)];
            o->pid = p;
            o->leave_ns = now;
            o->oncpu_ns += oncpu;
            o->shared_oncpu_ns += (t->tot[WSIG_ONCPU] - m->base_tot[WSIG_ONCPU]) - oncpu;
            o->runq_ns += own_delta(t, m, WSIG_RUNQ);
            o->minflt += own_delta(t, m, WSIG_MINFLT);
            o->majflt += own_delta(t, m, WSIG_MAJFLT);
            o->tlb_a += own_delta(t, m, WSIG_TLB_A);
            o->tlb_b += own_delta(t, m, WSIG_TLB_B);
        }
    }
    u64 unexplained = ws->unexplained;
    if (ws->gap_ts && now > ws->gap_ts)
        unexplained += now - ws->gap_ts;
    rec->unexplained_wait_ns = unexplained;
    rec->ws_threads = ws->n;
    rec->ws_processes = procs;
    rec->ws_shared_with_max = ws->shared_max;
    rec->ws_unslotted = ws->unslotted;
    rec->ws_refused = ws->refused;
    rec->ws_nslots = ws->nslots;
    rec->ws_flags |= ws->flags | WSF_TRACKED;
#ifdef WITH_CUDA
    cuda_snapshot(rec, &key);
#endif
}

/* The request ended at end_ns: every member still in its set leaves, and the set is gone. */
static __always_inline void ws_close(u64 conn_id, u64 seq, u64 end_ns)
{
    struct ws_key key = {.conn_id = conn_id, .seq = seq};
    struct workset *ws = worksets.lookup(&key);
    if (!ws) {
        count(CNT_WORKSET_LOST);
        return;
    }
#pragma clang loop unroll(disable)
    for (u32 i = 0; i < WS_MAX; i++) {
        if (i >= *(volatile u32 *)&ws->n)
            break;
        struct ws_mem *m = &ws->m[i & (WS_MAX - 1)];
        if (!m->left) {
            u32 tid = m->tid;
            ws_end(ws, &key, i, threads.lookup(&tid), end_ns);
        }
    }
    worksets.delete(&key);
#ifdef WITH_CUDA
    cuda_ws.delete(&key);
#endif
}

/* At the start of each response write (sock_send_length, before the scanner): if the write ends
 * the response, the record goes out with the work set as of now (the scanner, at the verifier's
 * limit, does no work-set work). */
static __always_inline void ws_checkpoint(u64 sk, struct conn *c, u64 now)
{
    u64 seq = c->head;
    if (c->ghost_bits & (1ULL << (seq & 63)))
        return;                 /* untracked: no record */
    struct http_record *rec = h1_record(sk, c, seq);
    if (rec && (rec->ws_flags & WSF_STATS))
        ws_snapshot(rec, now);
}

/* The thread (totals t) blocked (asleep) or was woken: the reader's state and the count of
 * awake helpers of every set it is in, for the unexplained wait. */
static __always_inline void ws_blocked(struct tstat *t, u32 asleep, u64 now)
{
#pragma unroll
    for (int r = 0; r < WS_REFS; r++) {
        struct ws_key k = {.conn_id = t->refs[r].conn_id, .seq = t->refs[r].seq};
        if (!k.conn_id)
            continue;
        struct workset *ws = worksets.lookup(&k);
        if (!ws) {
            ref_stale(t, r, now);
            continue;
        }
        u32 idx = t->refs[r].idx;
        if (idx & REF_REPLIED)
            continue;           /* left: its blocking is none of the set's business */
        if (idx == 0)
            ws->reader_blocked = asleep;
        else if (asleep && ws->helpers_awake)
            ws->helpers_awake--;
        else if (!asleep)
            ws->helpers_awake++;
        ws_gap(ws, now);
    }
}

/* Wakes from interrupt context name the interrupted task, not a cause: a timer ending someone's
 * sleep, a device completing I/O. Network receive softirqs are kept: a loopback send delivers in
 * the sender's own softirq, which is the hand-off we follow. The depth is per CPU; an entry
 * whose exit was never seen (no interrupt context lasts this long) is forgotten after
 * IRQ_STALE_NS. */
#define IRQ_STALE_NS 100000000ULL

struct irq_depth_t {
    u32 depth;
    u32 _pad;
    u64 since;                  /* when depth last rose from 0 */
};
BPF_PERCPU_ARRAY(irqctx, struct irq_depth_t, 1);

static __always_inline void irq_depth(int enter)
{
    int z = 0;
    struct irq_depth_t *d = irqctx.lookup(&z);
    if (!d)
        return;
    if (enter) {
        if (!d->depth)
            d->since = bpf_ktime_get_ns();
        d->depth++;
    } else if (d->depth) {
        d->depth--;
    }
}

static __always_inline int in_irq_ctx(void)
{
    int z = 0;
    struct irq_depth_t *d = irqctx.lookup(&z);
    if (!d || !d->depth)
        return 0;
    if (bpf_ktime_get_ns() - d->since > IRQ_STALE_NS) {
        d->depth = 0;
        return 0;
    }
    return 1;
}

/* Raw tracepoints: they only mark the context, and a raw one fills no perf trace record
 * (softirq_entry/exit's argument is unsigned int vec_nr). An entry may attach before its exit:
 * an interrupt that enters between the two leaves the depth one too high, which IRQ_STALE_NS
 * undoes (in_irq_ctx). */
static __always_inline int not_net_softirq(u64 vec)
{
    return vec != NET_RX_SOFTIRQ_ && vec != NET_TX_SOFTIRQ_;
}
RAW_TRACEPOINT_PROBE(irq_handler_exit) { irq_depth(0); return 0; }
RAW_TRACEPOINT_PROBE(hrtimer_expire_exit) { irq_depth(0); return 0; }
RAW_TRACEPOINT_PROBE(softirq_exit)
{
    if (not_net_softirq(ctx->args[0]))
        irq_depth(0);
    return 0;
}
#ifdef WITH_IRQ_VECTORS
/* x86: irq_work runs in its own interrupt (a BPF ring buffer or perf wakeup is one). */
RAW_TRACEPOINT_PROBE(irq_work_exit) { irq_depth(0); return 0; }
RAW_TRACEPOINT_PROBE(irq_work_entry) { irq_depth(1); return 0; }
#endif
RAW_TRACEPOINT_PROBE(irq_handler_entry) { irq_depth(1); return 0; }
RAW_TRACEPOINT_PROBE(hrtimer_expire_entry) { irq_depth(1); return 0; }
RAW_TRACEPOINT_PROBE(softirq_entry)
{
    if (not_net_softirq(ctx->args[0]))
        irq_depth(1);
    return 0;
}

/* Whether a wake by the current thread (id) of a task with these flags may add it to a set: not
 * a kernel thread (they run deferred work for everyone: softirqs, workqueues), not the agent
 * (woken to read the records: it never works for a request it traces), and not a wake
 * made while the waker reads or writes a served connection of one of its sets (that wakes the
 * connection's client: the response arriving). */
static __always_inline int ws_may_join(struct tstat *t, u64 id, u32 flags, u32 wakee_pid)
{
    u32 zero = 0, *agent = agent_tgid.lookup(&zero);
    if ((flags & PF_KTHREAD_) || (agent && wakee_pid == *agent))
        return 0;
    struct sc_args a = {};
    if (!syscall_args(&a) || syscall_dir(a.nr) < 0)
        return 1;
    u32 fd = a.fd, pid = id >> 32;
#pragma unroll
    for (int r = 0; r < WS_REFS; r++) {
        struct ws_key k = {.conn_id = t->refs[r].conn_id, .seq = t->refs[r].seq};
        if (!k.conn_id)
            continue;
        struct workset *ws = worksets.lookup(&k);
        if (ws && ws->pid == pid && ws->fd == fd)
            return 0;
    }
    return 1;
}

/* What one wake decides once and carries from one of the waker's sets to the next. */
struct ws_wake_state {
    s32 may_join;               /* -1: not decided yet (decided at the first join) */
    u32 wakee_pid;
    char comm[16];
};

/* One of the waker's open sets, its reference r: a wakee outside the set joins it; waking the
 * reader is the reply, and the waker leaves. 0: stop, the wakee may join no set of this wake.
 * p's fields are read at offsets the agent took from the running kernel's BTF (TASK_*_OFF), only
 * those the case needs. */
static __always_inline int ws_wake_ref(struct tstat *t, u32 r, void *p, u32 wakee, u64 id,
                                       u64 now, struct ws_wake_state *s)
{
    struct ws_ref *ref = &t->refs[r & (WS_REFS - 1)];
    struct ws_key k = {.conn_id = ref->conn_id, .seq = ref->seq};
    u32 my_idx = ref->idx;
    u32 replied = my_idx & REF_REPLIED;
    my_idx &= ~REF_REPLIED;
    if (!k.conn_id)
        return 1;
    struct workset *ws = worksets.lookup(&k);
    if (!ws) {
        ref_stale(t, r, now);
        return 1;
    }
    int wi = ws_find(ws, wakee);
    if (wi >= 0 && !ws->m[wi & (WS_MAX - 1)].left) {
        /* The reply is a wake of the reader: the waker leaves, keeping a reference. A wake of
         * another member is no reply (lock and GIL hand-offs between helpers are wakes too). A
         * GIL hand-off to the reader looks like a reply, so a helper that then hands the work
         * on (wakes a thread outside the set) rejoins below: a ProcessPoolExecutor's feeder
         * thread gives the GIL back to the handler before it writes the task to the worker
         * process. */
        if (!replied && my_idx != 0 && wi == 0) {
            ws_end(ws, &k, my_idx, t, now);
            ref->conn_id = k.conn_id;
            ref->seq = k.seq;
            ref->idx = my_idx | REF_REPLIED;
            t->nreplied++;
            u32 slot = ws->m[my_idx & (WS_MAX - 1)].slot;
            if (slot < WS_SLOTS)
                bpf_get_current_comm(&ws->slots[slot & (WS_SLOTS - 1)].comm,
                                     sizeof(ws->slots[0].comm));
        }
        return 1;
    }
    if (s->may_join < 0) {
        /* A thread serving a request it read works for that request: a wake from another
         * request's member (a lock or GIL hand-off between two handlers, a proxy's upstream
         * call reaching a server traced on its own) does not make it this one's helper. */
        struct tstat *known = threads.lookup(&wakee);
        u32 flags = kernel_u32((u64)p + TASK_FLAGS_OFF);
        s->wakee_pid = kernel_u32((u64)p + TASK_TGID_OFF);
        s->may_join = !(known && known->reading) && ws_may_join(t, id, flags, s->wakee_pid);
        if (!s->may_join)
            return 0;
        bpf_probe_read_kernel(&s->comm, sizeof(s->comm), p + TASK_COMM_OFF);
    }
    if (!s->may_join)
        return 0;
    if (replied)
        ws_begin(ws, &k, my_idx, t, now);   /* it hands the work on: not a reply after all */
    struct tstat *w = thread_for(wakee, 0, now);
    if (!w)
        return 1;
    w->tgid = s->wakee_pid;
    if (wi >= 0)
        ws_begin(ws, &k, wi, w, now);       /* a member that had left is handed more */
    else
        ws_add(ws, &k, wakee, w, s->comm, now);
    return 1;
}

/* The rest of a wake, after the waker's first reference: one tail call of ws_wake_more per
 * further reference that names a set, with the wake's state in a per-CPU slot. One reference
 * per program, so the verifier walks the step twice (ws_wake_prog's and ws_wake_more's), not
 * once per reference with every state the earlier ones can leave (bench.verifier_cost). */
struct ws_wake_cont {
    u64 task;                   /* the wakee: the slot is this wake's, and is used once */
    u64 now;
    u32 waker;
    u32 r;                      /* the reference ws_wake_more takes */
    struct ws_wake_state s;
};
BPF_PERCPU_ARRAY(ws_wake_conts, struct ws_wake_cont, 1);
BPF_PROG_ARRAY(ws_progs, 2);    /* [0]: ws_wake_prog, [1]: ws_wake_more, loaded by user space */

/* Hand the wake on to ws_wake_more for t's next reference after r that names a set, if any. */
static __always_inline int ws_wake_on(struct bpf_raw_tracepoint_args *ctx, struct tstat *t,
                                      u32 r, u32 me, u64 now, struct ws_wake_state *s)
{
    u32 next = WS_REFS;
#pragma unroll
    for (u32 j = WS_REFS - 1; j > 0; j--)
        if (j > r && t->refs[j].conn_id)
            next = j;
    if (next >= WS_REFS)
        return 0;
    int z = 0;
    struct ws_wake_cont *c = ws_wake_conts.lookup(&z);
    if (!c)
        return 0;
    c->task = ctx->args[0];
    c->now = now;
    c->waker = me;
    c->r = next;
    c->s = *s;
    ws_progs.call(ctx, 1);
    return 0;
}

/* The current thread wakes task p (or created it): the waker's first reference. */
int ws_wake_prog(struct bpf_raw_tracepoint_args *ctx)
{
    void *p = (void *)ctx->args[0];
    u64 id = bpf_get_current_pid_tgid();
    u32 me = (u32)id;
    struct tstat *t = threads.lookup(&me);
    if (!t || !(t->nopen || t->nreplied))
        return 0;
    if (in_irq_ctx())
        return 0;
    u32 wakee = kernel_u32((u64)p + TASK_PID_OFF);
    if (wakee == me || wakee == 0)
        return 0;
    t->tgid = id >> 32;
    u64 now = bpf_ktime_get_ns();
    struct ws_wake_state s = {.may_join = -1};
    if (!ws_wake_ref(t, 0, p, wakee, id, now, &s))
        return 0;
    return ws_wake_on(ctx, t, 0, me, now, &s);
}

/* The same wake, at the waker's reference the continuation names. */
int ws_wake_more(struct bpf_raw_tracepoint_args *ctx)
{
    void *p = (void *)ctx->args[0];
    u64 id = bpf_get_current_pid_tgid();
    u32 me = (u32)id;
    int z = 0;
    struct ws_wake_cont *c = ws_wake_conts.lookup(&z);
    if (!c || c->task != (u64)p || c->waker != me)
        return 0;
    c->task = 0;                /* taken: a chain cut short leaves nothing for a later wake */
    u32 r = c->r;
    struct tstat *t = threads.lookup(&me);
    if (!t || r == 0 || r >= WS_REFS)
        return 0;
    u32 wakee = kernel_u32((u64)p + TASK_PID_OFF);
    if (!ws_wake_ref(t, r, p, wakee, id, c->now, &c->s))
        return 0;
    return ws_wake_on(ctx, t, r, me, c->now, &c->s);
}

/* Raw tracepoints: their argument is the woken (or new) task itself, which the flags and process
 * are read from; sched_waking fires in the waker's context, wake_up_new_task in the creator's.
 * Both exit early for a waker in no open work set (one `threads` lookup), and tail-call the
 * program that does the rest (verified once, not once per tracepoint). */
static __always_inline int ws_wake_entry(struct bpf_raw_tracepoint_args *ctx)
{
    struct tstat *t = thread_of((u32)bpf_get_current_pid_tgid());
    if (t && (t->nopen || t->nreplied))
        ws_progs.call(ctx, 0);
    return 0;
}

RAW_TRACEPOINT_PROBE(sched_waking) { return ws_wake_entry(ctx); }
RAW_TRACEPOINT_PROBE(sched_wakeup_new) { return ws_wake_entry(ctx); }
#endif /* WITH_WORKSET */
