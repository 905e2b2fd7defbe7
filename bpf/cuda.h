/* CUDA work per request (docs/attributes.md "CUDA"): uprobes on the host-side CUDA runtime
 * (libcudart) and driver (libcuda) calls that explain GPU latency, summed over the request's
 * work set. Part of the bpf/http.c compile unit, included by http_workset.h (WITH_CUDA needs
 * WITH_WORKSET: a call is the request's when a thread of its work set makes it).
 *
 * Per call: the entry program looks the thread up in `threads`; a thread in no open work set
 * stops there (counted as cuda_unattributed). Otherwise the call is remembered per thread
 * (cuda_calls) and accounted at its return, into the CUDA sums of every open work set the
 * thread holds a reference to (cuda_ws, keyed like `worksets`). A thread that works for more
 * than one open request at once (nopen > 1: a batching GPU worker) adds to the sets' shared[]
 * sums, never to their own: the same rule as the work set's kernel signals.
 *
 * Runtime over driver: cudaMemcpy calls cuMemcpy* beneath it. A probed call that starts while
 * another probed call is running on the same thread's stack (its stack pointer at or below the
 * outer call's: at, when the runtime tail-calls the driver) is nested: it is not counted again
 * (cuda_nested). A call whose return was never seen (longjmp, a thread killed) leaves a marker
 * whose frame is gone: a later call above that stack depth, or any call once the marker is
 * older than CUDA_NEST_WINDOW_NS, replaces it, so a lost return never hides calls for long.
 */

/* The probed calls, one row each: X(api, symbol, class, bytes argument, direction or kind
 * argument, return probe). agent/kernel/cuda.py reads this table to attach (row `api` ->
 * program cuda_e_<api> at the entry, and cuda_ret at the return where the last column is 1), so
 * it is the one list. Argument numbers are 1-based (0: none). CC_COPY_KIND: the direction comes
 * from a cudaMemcpyKind argument; CC_COPY: it is fixed by the call (a CSIG_MEMCPY_* index).
 * Kernel launches (CC_LAUNCH) are attached only with --cuda-launches: they sit on the critical
 * path. Return probes: every runtime call (its return ends the window in which the driver calls
 * beneath it are nested) and every synchronisation (its wait is entry -> return). A driver copy,
 * allocation, free or launch has none: a uprobe hit costs microseconds, and nothing needs its
 * return, so it is counted at its entry (its result unknown: a failed one counts too).
 * Not probed: cudaMemcpy2D/3D and their driver twins (the kind is a 7th argument, on the stack). */
#define CUDA_APIS(X) \
    X(0, cudaMemcpy, CC_COPY_KIND, 3, 4, 1) \
    X(1, cudaMemcpy_ptds, CC_COPY_KIND, 3, 4, 1) \
    X(2, cudaMemcpyAsync, CC_COPY_KIND, 3, 4, 1) \
    X(3, cudaMemcpyAsync_ptsz, CC_COPY_KIND, 3, 4, 1) \
    X(4, cudaMemcpyToSymbol, CC_COPY_KIND, 3, 5, 1) \
    X(5, cudaMemcpyFromSymbol, CC_COPY_KIND, 3, 5, 1) \
    X(6, cudaMemcpyPeer, CC_COPY, 5, CSIG_MEMCPY_OTHER, 1) \
    X(7, cudaMemcpyPeerAsync, CC_COPY, 5, CSIG_MEMCPY_OTHER, 1) \
    X(8, cuMemcpyHtoD_v2, CC_COPY, 3, CSIG_MEMCPY_H2D, 0) \
    X(9, cuMemcpyHtoD_v2_ptds, CC_COPY, 3, CSIG_MEMCPY_H2D, 0) \
    X(10, cuMemcpyDtoH_v2, CC_COPY, 3, CSIG_MEMCPY_D2H, 0) \
    X(11, cuMemcpyDtoH_v2_ptds, CC_COPY, 3, CSIG_MEMCPY_D2H, 0) \
    X(12, cuMemcpyDtoD_v2, CC_COPY, 3, CSIG_MEMCPY_D2D, 0) \
    X(13, cuMemcpyDtoD_v2_ptds, CC_COPY, 3, CSIG_MEMCPY_D2D, 0) \
    X(14, cuMemcpyHtoDAsync_v2, CC_COPY, 3, CSIG_MEMCPY_H2D, 0) \
    X(15, cuMemcpyHtoDAsync_v2_ptsz, CC_COPY, 3, CSIG_MEMCPY_H2D, 0) \
    X(16, cuMemcpyDtoHAsync_v2, CC_COPY, 3, CSIG_MEMCPY_D2H, 0) \
    X(17, cuMemcpyDtoHAsync_v2_ptsz, CC_COPY, 3, CSIG_MEMCPY_D2H, 0) \
    X(18, cuMemcpyDtoDAsync_v2, CC_COPY, 3, CSIG_MEMCPY_D2D, 0) \
    X(19, cuMemcpyDtoDAsync_v2_ptsz, CC_COPY, 3, CSIG_MEMCPY_D2D, 0) \
    X(20, cuMemcpy, CC_COPY, 3, CSIG_MEMCPY_OTHER, 0) \
    X(21, cuMemcpy_ptds, CC_COPY, 3, CSIG_MEMCPY_OTHER, 0) \
    X(22, cuMemcpyAsync, CC_COPY, 3, CSIG_MEMCPY_OTHER, 0) \
    X(23, cuMemcpyAsync_ptsz, CC_COPY, 3, CSIG_MEMCPY_OTHER, 0) \
    X(24, cuMemcpyPeer, CC_COPY, 5, CSIG_MEMCPY_OTHER, 0) \
    X(25, cuMemcpyPeerAsync, CC_COPY, 5, CSIG_MEMCPY_OTHER, 0) \
    X(26, cudaStreamSynchronize, CC_SYNC, 0, 0, 1) \
    X(27, cudaStreamSynchronize_ptsz, CC_SYNC, 0, 0, 1) \
    X(28, cudaDeviceSynchronize, CC_SYNC, 0, 0, 1) \
    X(29, cudaEventSynchronize, CC_SYNC, 0, 0, 1) \
    X(30, cuStreamSynchronize, CC_SYNC, 0, 0, 1) \
    X(31, cuStreamSynchronize_ptsz, CC_SYNC, 0, 0, 1) \
    X(32, cuCtxSynchronize, CC_SYNC, 0, 0, 1) \
    X(33, cuEventSynchronize, CC_SYNC, 0, 0, 1) \
    X(34, cudaGraphLaunch, CC_GRAPH, 0, 0, 1) \
    X(35, cudaGraphLaunch_ptsz, CC_GRAPH, 0, 0, 1) \
    X(36, cuGraphLaunch, CC_GRAPH, 0, 0, 0) \
    X(37, cuGraphLaunch_ptsz, CC_GRAPH, 0, 0, 0) \
    X(38, cudaMalloc, CC_ALLOC, 2, 0, 1) \
    X(39, cudaMallocManaged, CC_ALLOC, 2, 0, 1) \
    X(40, cudaMallocHost, CC_ALLOC, 2, 0, 1) \
    X(41, cudaHostAlloc, CC_ALLOC, 2, 0, 1) \
    X(42, cudaMallocAsync, CC_ALLOC, 2, 0, 1) \
    X(43, cudaMallocAsync_ptsz, CC_ALLOC, 2, 0, 1) \
    X(44, cudaMallocFromPoolAsync, CC_ALLOC, 2, 0, 1) \
    X(45, cuMemAlloc_v2, CC_ALLOC, 2, 0, 0) \
    X(46, cuMemAllocManaged, CC_ALLOC, 2, 0, 0) \
    X(47, cuMemAllocHost_v2, CC_ALLOC, 2, 0, 0) \
    X(48, cuMemHostAlloc, CC_ALLOC, 2, 0, 0) \
    X(49, cuMemAllocAsync, CC_ALLOC, 2, 0, 0) \
    X(50, cuMemAllocAsync_ptsz, CC_ALLOC, 2, 0, 0) \
    X(51, cuMemAllocFromPoolAsync, CC_ALLOC, 2, 0, 0) \
    X(52, cudaFree, CC_FREE, 0, 0, 1) \
    X(53, cudaFreeHost, CC_FREE, 0, 0, 1) \
    X(54, cudaFreeAsync, CC_FREE, 0, 0, 1) \
    X(55, cudaFreeAsync_ptsz, CC_FREE, 0, 0, 1) \
    X(56, cuMemFree_v2, CC_FREE, 0, 0, 0) \
    X(57, cuMemFreeHost, CC_FREE, 0, 0, 0) \
    X(58, cuMemFreeAsync, CC_FREE, 0, 0, 0) \
    X(59, cuMemFreeAsync_ptsz, CC_FREE, 0, 0, 0) \
    X(60, cudaLaunchKernel, CC_LAUNCH, 0, 0, 1) \
    X(61, cudaLaunchKernel_ptsz, CC_LAUNCH, 0, 0, 1) \
    X(62, cudaLaunchKernelExC, CC_LAUNCH, 0, 0, 1) \
    X(63, cudaLaunchKernelExC_ptsz, CC_LAUNCH, 0, 0, 1) \
    X(64, cuLaunchKernel, CC_LAUNCH, 0, 0, 0) \
    X(65, cuLaunchKernel_ptsz, CC_LAUNCH, 0, 0, 0) \
    X(66, cuLaunchKernelEx, CC_LAUNCH, 0, 0, 0) \
    X(67, cuLaunchKernelEx_ptsz, CC_LAUNCH, 0, 0, 0)

enum { CC_COPY_KIND, CC_COPY, CC_SYNC, CC_GRAPH, CC_LAUNCH, CC_ALLOC, CC_FREE };

/* A marker older than this is taken for one whose return was lost, not for an outer call: the
 * runtime calls the driver beneath it at once, or after its lazy initialisation (well under). */
#define CUDA_NEST_WINDOW_NS 10000000000ULL

#ifndef CUDA_SYNC_THRESHOLD_NS
#define CUDA_SYNC_THRESHOLD_NS 1000000
#endif

/* A probed call running on a thread: from its entry to its return. */
struct cuda_call {
    u64 ts;                     /* entry */
    u64 sp;                     /* stack pointer at the entry: calls below it are nested */
    u64 bytes;
    u32 depth;                  /* 1 + nested probed calls still running beneath it */
    u16 api;
    u8 cls;                     /* CC_* */
    u8 sig;                     /* CC_COPY*: the CSIG_MEMCPY_* direction */
};

BPF_TABLE("lru_hash", u32, struct cuda_call, cuda_calls, LRU_ENTRIES);
BPF_TABLE("lru_hash", struct ws_key, struct cuda_block, cuda_ws, WS_ENTRIES);
BPF_PERCPU_ARRAY(zero_cuda, struct cuda_block, 1);      /* never written: a zeroed template */

static __always_inline void cuda_account(struct cuda_call *c, u32 tid, int rc, u64 now);

/* A call counted at its entry (no return probe) is handed to cuda_count, a tail call on the
 * same CPU: cuda_account is then compiled and verified once, not in each of 35 entry programs
 * (it was ~2 s of a --cuda compile's CPU, bench.compile_units --cuda). */
BPF_PERCPU_ARRAY(cuda_entry_call, struct cuda_call, 1);
BPF_PROG_ARRAY(cuda_progs, 1);          /* [0]: cuda_count, put there by CudaProbes.start */

static __always_inline u64 cuda_arg(struct pt_regs *ctx, u32 n)
{
    switch (n) {
    case 1: return PT_REGS_PARM1(ctx);
    case 2: return PT_REGS_PARM2(ctx);
    case 3: return PT_REGS_PARM3(ctx);
    case 4: return PT_REGS_PARM4(ctx);
    case 5: return PT_REGS_PARM5(ctx);
    case 6: return PT_REGS_PARM6(ctx);
    }
    return 0;
}

/* cudaMemcpyKind -> CSIG_MEMCPY_*: 1 HostToDevice, 2 DeviceToHost, 3 DeviceToDevice; 0
 * HostToHost and 4 Default (inferred from unified addresses) are "other". */
static __always_inline u8 copy_dir(u64 kind)
{
    if (kind == 1)
        return CSIG_MEMCPY_H2D;
    if (kind == 2)
        return CSIG_MEMCPY_D2H;
    if (kind == 3)
        return CSIG_MEMCPY_D2D;
    return CSIG_MEMCPY_OTHER;
}

static __always_inline int cuda_enter(struct pt_regs *ctx, u16 api, u8 cls, u32 barg, u32 darg,
                                      int ret)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct tstat *t = threads.lookup(&tid);
    if (!t || !t->nopen) {
        count(CNT_CUDA_UNATTRIBUTED);
        return 0;
    }
    u64 sp = PT_REGS_SP(ctx), now = bpf_ktime_get_ns();
    struct cuda_call *c = cuda_calls.lookup(&tid);
    /* At or below the outer call's stack pointer (at: the runtime tail-called the driver) */
    if (c && c->depth && sp <= c->sp && now - c->ts < CUDA_NEST_WINDOW_NS) {
        if (ret)
            c->depth++;         /* beneath a probed call still running: it counts this one */
        count(CNT_CUDA_NESTED);
        return 0;
    }
    struct cuda_call n = {
        .ts = now,
        .sp = sp,
        .bytes = cuda_arg(ctx, barg),
        .depth = 1,
        .api = api,
        .cls = cls,
        .sig = cls == CC_COPY_KIND ? copy_dir(cuda_arg(ctx, darg)) : (u8)darg,
    };
    if (ret) {
        cuda_calls.update(&tid, &n);
        return 0;
    }
    int z = 0;                          /* no return probe: counted now, by cuda_count */
    struct cuda_call *slot = cuda_entry_call.lookup(&z);
    if (!slot)
        return 0;
    *slot = n;
    cuda_progs.call(ctx, 0);
    slot->depth = 0;                    /* only if the tail call failed: nothing counted it */
    count(CNT_CUDA_ACC_LOST);
    return 0;
}

/* The CUDA sums of open work set k, created zeroed when missing. */
static __always_inline struct cuda_block *cuda_sums(struct ws_key *k)
{
    struct cuda_block *acc = cuda_ws.lookup(k);
    if (acc)
        return acc;
    int z = 0;
    struct cuda_block *zero = zero_cuda.lookup(&z);
    if (!zero)
        return 0;
    cuda_ws.update(k, zero);
    acc = cuda_ws.lookup(k);
    if (!acc)
        count(CNT_CUDA_ACC_LOST);
    return acc;
}

static __always_inline void cuda_add(struct cuda_block *acc, u32 sig, u64 v, int shared)
{
    if (sig >= CSIG_COUNT)
        return;
    if (shared)
        acc->shared[sig] += v;
    else
        acc->own[sig] += v;
}

/* Keep the wait if it is among the set's CUDA_WAIT_SLOTS longest. */
static __always_inline void cuda_keep_wait(struct cuda_block *acc, struct cuda_call *c, u32 tid,
                                           u64 dur, int shared)
{
    u32 victim = 0;
    u64 least = ~0ULL;
#pragma unroll
    for (u32 i = 0; i < CUDA_WAIT_SLOTS; i++) {
        if (acc->waits[i].dur_ns < least) {
            least = acc->waits[i].dur_ns;
            victim = i;
        }
    }
    if (dur <= least)
        return;
    struct cuda_wait *w = &acc->waits[victim & (CUDA_WAIT_SLOTS - 1)];
    w->start_ns = c->ts;
    w->dur_ns = dur;
    w->tid = tid;
    w->api = c->api;
    w->shared = shared;
}

/* The call returned with rc: add it to every open work set the thread works for. */
static __always_inline void cuda_account(struct cuda_call *c, u32 tid, int rc, u64 now)
{
    struct tstat *t = threads.lookup(&tid);
    if (!t || !t->nopen) {
        count(CNT_CUDA_UNATTRIBUTED);   /* it left every set while the call ran */
        return;
    }
    int shared = t->nopen > 1;
    u64 dur = now > c->ts ? now - c->ts : 0;
    u8 cls = c->cls;
#pragma unroll
    for (int r = 0; r < WS_REFS; r++) {
        struct ws_key k = {.conn_id = t->refs[r].conn_id, .seq = t->refs[r].seq};
        if (!k.conn_id || (t->refs[r].idx & REF_REPLIED))
            continue;
        if (!worksets.lookup(&k))
            continue;           /* ended: the thread lets go of it at its next sched event */
        struct cuda_block *acc = cuda_sums(&k);
        if (!acc)
            continue;
        if (rc != 0) {
            cuda_add(acc, CSIG_ERRORS, 1, shared);
            continue;
        }
        if (cls == CC_COPY_KIND || cls == CC_COPY) {
            cuda_add(acc, c->sig, c->bytes, shared);
            cuda_add(acc, CSIG_MEMCPY_CALLS, 1, shared);
        } else if (cls == CC_SYNC) {
            cuda_add(acc, CSIG_SYNC_NS, dur, shared);
            cuda_add(acc, CSIG_SYNC_CALLS, 1, shared);
            if (dur >= CUDA_SYNC_THRESHOLD_NS)
                cuda_keep_wait(acc, c, tid, dur, shared);
        } else if (cls == CC_GRAPH) {
            cuda_add(acc, CSIG_GRAPH_LAUNCHES, 1, shared);
        } else if (cls == CC_LAUNCH) {
            cuda_add(acc, CSIG_LAUNCHES, 1, shared);
        } else if (cls == CC_ALLOC) {
            cuda_add(acc, CSIG_ALLOC_BYTES, c->bytes, shared);
            cuda_add(acc, CSIG_ALLOC_CALLS, 1, shared);
        } else {
            cuda_add(acc, CSIG_FREE_CALLS, 1, shared);
        }
    }
}

/* A call counted at its entry: what its entry program left in cuda_entry_call. */
int cuda_count(struct pt_regs *ctx)
{
    int z = 0;
    struct cuda_call *c = cuda_entry_call.lookup(&z);
    if (!c || !c->depth)
        return 0;
    struct cuda_call call = *c;
    c->depth = 0;
    cuda_account(&call, (u32)bpf_get_current_pid_tgid(), 0, call.ts);
    return 0;
}

/* Every probed call's return. */
int cuda_ret(struct pt_regs *ctx)
{
    u32 tid = (u32)bpf_get_current_pid_tgid();
    struct cuda_call *c = cuda_calls.lookup(&tid);
    if (!c || !c->depth)
        return 0;
    if (--c->depth)
        return 0;               /* a nested call returned: the outer one is still running */
    struct cuda_call call = *c;
    cuda_calls.delete(&tid);
    cuda_account(&call, tid, (int)PT_REGS_RC(ctx), bpf_ktime_get_ns());
    return 0;
}

/* One entry program per row of CUDA_APIS: cuda_e_<api>. Made in two lines, the rows with a
 * return probe and the rows without (the `ret` column picks CUDA_ENTRY or nothing by token
 * pasting), so the agent's two compilers can take one each (agent/kernel/compiled.py,
 * unit_texts): 68 copies of cuda_enter are ~1.9 s of the compiler's CPU. */
#define CUDA_ENTRY(api, sym, cls, barg, darg, ret) \
    int cuda_e_##api(struct pt_regs *ctx) { return cuda_enter(ctx, api, cls, barg, darg, ret); }
#define CUDA_ENTRY_IF_1(...) CUDA_ENTRY(__VA_ARGS__)
#define CUDA_ENTRY_IF_0(...)
#define CUDA_ENTRY_UNLESS_1(...)
#define CUDA_ENTRY_UNLESS_0(...) CUDA_ENTRY(__VA_ARGS__)
#define CUDA_RETURNING(api, sym, cls, barg, darg, ret) \
    CUDA_ENTRY_IF_##ret(api, sym, cls, barg, darg, ret)
#define CUDA_AT_ENTRY(api, sym, cls, barg, darg, ret) \
    CUDA_ENTRY_UNLESS_##ret(api, sym, cls, barg, darg, ret)
CUDA_APIS(CUDA_RETURNING)
CUDA_APIS(CUDA_AT_ENTRY)

/* ws_snapshot: the set's CUDA sums go into the record, which is then sent whole (WSF_CUDA). */
static __always_inline void cuda_snapshot(struct http_record *rec, struct ws_key *key)
{
    struct cuda_block *acc = cuda_ws.lookup(key);
    if (!acc)
        return;
    __builtin_memcpy(&rec->cuda, acc, sizeof(rec->cuda));
    rec->ws_flags |= WSF_CUDA;
}
