"""Where the agent's CPU goes per traced request: the real pipeline, in-process, under cProfile.

    sudo python -m bench.profile_agent [--rate 1000] [--seconds 5] [--top 20] [--no-profile]
                                        [--batch-ms N] [--destination otlp|file] [--gc]
                                        [--unsampled] [--kernel-policy on|off]
                                        [--encoder compiled|join|python] [--ring compiled|bcc]
                                        [--save-records PATH] [--poll-ms N]
                                        [--framing compiled|python]

Builds the pipeline the way `tracejoin run` does (the daemon's span builder and destination:
OTLP/HTTP protobuf to bench/otlp_sink, or the OTLP-JSON file on tmpfs), starts the Go test
server on CPU1, and drives it with tj-loadgen at a constant rate that the agent keeps up with
(no ring-buffer loss). The agent's threads stay on CPU0. Per thread (the ring-buffer reader
and the exporter) it prints CPU µs per record, measured first without a profiler, then the
functions with the most own time under cProfile (which inflates everything several times: read
it for proportions, take the µs from the unprofiled pass).

--batch-ms N swaps the reader loop for the change docs/performance.md proposes: instead of
waking on every record (ring_buffer_poll: epoll returns as soon as one record is there), consume
whatever the ring holds every N ms (ring_buffer_consume), so the per-wake-up costs are shared by
a batch. Everything after the ring buffer is the agent's own code. --gc applies the other
proposed change: gc.freeze() after start-up and a gen-0 threshold of 100k allocations instead
of 700 (every span allocates a few dicts; the default collects every few records).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import io
import os
import pstats
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracejoin.exporters import otlp_proto
from tracejoin.exporters import queue as export_queue
from tracejoin.pipeline import span_bytes

from bench import measure as m

LOAD_CPU = [0]  # --load-cpu
SAVE_MAX = 5_000  # --save-records


def thread_cpu(tid: int) -> float:
    """The thread's CPU seconds, from the scheduler's own count (ns; utime + stime are 10 ms
    ticks, a few of them over a 1k req/s run)."""
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def threads_cpu() -> dict[str, float]:
    """CPU seconds of every thread of this process, by its Python thread's name (threads
    Python did not start: "native"); same names summed."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            name = names.get(int(task.name), "native")
            out[name] = out.get(name, 0.0) + thread_cpu(int(task.name))
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return out


class Watched:
    """Wraps a thread's target: remembers its native id; optionally profiles it."""

    def __init__(self, name: str, target: Callable[[], None], profile: bool) -> None:
        self.name = name
        self.target = target
        # CPU time, not wall time: the reader blocks in epoll, the exporter on its queue
        self.prof = cProfile.Profile(time.thread_time) if profile else None
        self.tid = 0
        self.started = threading.Event()

    def __call__(self) -> None:
        self.tid = threading.get_native_id()
        self.started.set()
        if self.prof is None:
            self.target()
            return
        self.prof.enable()
        try:
            self.target()
        finally:
            self.prof.disable()


def run_once(
    port: int,
    rate: float,
    seconds: float,
    profile: bool,
    batch_ms: float = 0,
    sink_port: int | None = None,
    unsampled: bool = False,
    kernel_policy: bool = True,
    ring: str = "compiled",
    saved: list[bytes] | None = None,
) -> dict[str, Any]:
    from tracejoin.app import build_agent, file_destination, otlp_destination
    from tracejoin.config import Settings
    from tracejoin.core.metrics import Metrics
    from tracejoin.pipeline.stages import Pipeline

    endpoint = f"http://127.0.0.1:{sink_port}" if sink_port else None
    settings = Settings(
        port=(port,), gpu=False, otlp_endpoint=endpoint, otlp_protocol="http/protobuf"
    )
    metrics = Metrics()
    tmp = Path(tempfile.mkdtemp(prefix="tjprof-", dir="/dev/shm"))
    dest: Any = (
        otlp_destination(settings, metrics)
        if endpoint
        else file_destination(tmp / "spans.otlp.jsonl", settings, metrics)
    )
    agent = build_agent(settings, metrics, [dest])
    if ring == "bcc":  # the fallback reader: BCC's, one Python callback per record
        agent.source.config = dataclasses.replace(agent.source.config, compiled_ring=False)
    if not kernel_policy:  # as before issue 13: every record crosses and user space decides
        agent.source.set_policy = lambda **_kw: None  # type: ignore[attr-defined]
    # the reader's CPU inside source.poll(): taking records off the ring (and the wait's
    # syscall), apart from what the stages do with them
    poll_cpu = [0.0]
    plain_poll = agent.source.poll

    def timed_poll(timeout_ms: int = 100) -> list[bytes]:
        t = time.thread_time()
        try:
            batch = plain_poll(timeout_ms)
        finally:
            poll_cpu[0] += time.thread_time() - t
        if saved is not None and len(saved) < SAVE_MAX:
            saved.extend(batch[: SAVE_MAX - len(saved)])
        return batch

    agent.source.poll = timed_poll  # type: ignore[method-assign]
    reader = Watched("reader", lambda: None, profile)
    exporter = Watched("exporter", dest._run, profile)
    dest._run = exporter
    plain_loop = Pipeline._read_loop

    def watched_loop(pipeline: Pipeline) -> None:
        def batched() -> None:  # consume what the ring holds every batch_ms, never block
            while not pipeline._stop.wait(batch_ms / 1e3):
                pipeline.process(pipeline.source.poll(0))

        reader.target = batched if batch_ms else lambda: plain_loop(pipeline)
        reader()

    Pipeline._read_loop = watched_loop  # type: ignore[method-assign]
    try:
        agent.start()
    finally:
        Pipeline._read_loop = plain_loop  # type: ignore[method-assign]
    reader.started.wait(5)
    exporter.started.wait(5)
    try:
        assert agent.pipeline is not None
        kernel = agent.pipeline.kernel_counters
        t0 = {w.name: thread_cpu(w.tid) for w in (reader, exporter)}
        all0 = threads_cpu()
        r0 = metrics.total("records_received")
        b0 = metrics.total("record_batches")
        poll0 = poll_cpu[0]
        spans0 = metrics.total("spans_built")
        kept0 = kernel().get("unsampled_aggregated", 0)
        proc0 = sum(m.cpu_seconds(os.getpid()))
        load = m.rate(
            port, "/", rate, seconds, 16, LOAD_CPU[0], warmup_s=0.3, nice=-10, unsampled=unsampled
        )
        deadline = time.monotonic() + 10
        want = load["total_sent"]
        while time.monotonic() < deadline:  # every request crossed, or stayed in the kernel
            kept = kernel().get("unsampled_aggregated", 0) - kept0
            if metrics.total("records_received") - r0 + kept >= want:
                break
            time.sleep(0.1)
        time.sleep(0.6)  # the file destination flushes every 0.5 s
        records = metrics.total("records_received") - r0
        batches = metrics.total("record_batches") - b0
        t1 = {w.name: thread_cpu(w.tid) for w in (reader, exporter)}
        all1 = threads_cpu()
        proc1 = sum(m.cpu_seconds(os.getpid()))
        poll1 = poll_cpu[0]
        spans = metrics.total("spans_built") - spans0
        counters = kernel()
    finally:
        agent.shutdown(5.0)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    per = {k: (t1[k] - t0[k]) * 1e6 / max(1, records) for k in t0}
    by_thread = {
        k: (all1[k] - all0.get(k, 0.0)) * 1e6 / max(1, records)
        for k in all1
        if all1[k] > all0.get(k, 0.0)
    }
    return {
        "records": int(records),
        "batches": int(batches),
        "requests": want,
        "ringbuf_full": counters.get("ringbuf_full", 0),
        "us_per_record": per,
        "us_per_record_by_thread": by_thread,
        "process_us_per_record": (proc1 - proc0) * 1e6 / max(1, records),
        "poll_us_per_record": (poll1 - poll0) * 1e6 / max(1, records),
        "spans_per_record": spans / max(1, records),
        "process_us_per_request": (proc1 - proc0) * 1e6 / max(1, want),
        "kept_in_kernel": counters.get("unsampled_aggregated", 0) - kept0,
        "profiles": {w.name: w.prof for w in (reader, exporter) if w.prof is not None},
    }


def top(prof: cProfile.Profile, n: int, records: int) -> str:
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf)
    st.sort_stats("tottime").print_stats(n)
    lines = [f"    (µs per record = tottime / {records:,} records)"]
    stats: dict[Any, Any] = st.stats  # type: ignore[attr-defined]
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n]
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in rows:
        where = f"{Path(file).name}:{line}({fn})" if line else fn
        lines.append(
            f"    {tt * 1e6 / records:8.2f} own  {ct * 1e6 / records:8.2f} cum  "
            f"{nc / records:6.2f} calls/rec  {where}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--batch-ms", type=float, default=0.0, help="the batched reader (see above)")
    ap.add_argument(
        "--poll-ms",
        type=int,
        default=0,
        help="the reader's wait between batches (stages.POLL_MS) for this run, to compare values",
    )
    ap.add_argument("--destination", choices=["otlp", "file"], default="otlp")
    ap.add_argument("--gc", action="store_true", help="the proposed GC tuning (see above)")
    ap.add_argument(
        "--unsampled", action="store_true", help="every traceparent unsampled (flags 00)"
    )
    ap.add_argument(
        "--kernel-policy",
        choices=["on", "off"],
        default="on",
        help="off: the kernel sends every record and user space drops the unsampled (as before)",
    )
    ap.add_argument(
        "--load-cpu", type=int, default=0, help="CPU of the load generator (1: off the agent's)"
    )
    ap.add_argument(
        "--encoder",
        choices=span_bytes.ENCODERS,
        default="compiled",
        help="the span writer: compiled (as installed: the batch writer, and the server span in C "
        "for the records it leaves), server_span (every record through the stages, the server "
        "span in C: before 2026-12-05), join (the Python encoder on the compiled join: before "
        "2026-12-03), or python (no compiler)",
    )
    ap.add_argument(
        "--save-records",
        type=Path,
        help="write the first 5,000 raw records of the unprofiled pass here, for "
        "`bench.stages --records` to replay",
    )
    ap.add_argument(
        "--ring",
        choices=["compiled", "bcc"],
        default="compiled",
        help="the records ring's reader: the compiled consumer (as installed) or BCC's, one "
        "Python callback per record (the fallback)",
    )
    ap.add_argument(
        "--framing",
        choices=["compiled", "python"],
        default="compiled",
        help="the exporter's batch taking and request framing: _request_bytes.c (as installed) "
        "or the Python loops (the fallback; before 2026-12-05, late morning)",
    )
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("profile_agent: must run as root (BPF)", file=sys.stderr)
        return 2
    try:
        span_bytes.use_encoder(args.encoder)
        otlp_proto.use_compiled(args.framing == "compiled")
        export_queue.use_compiled(args.framing == "compiled")
    except RuntimeError as exc:
        print(f"profile_agent: {exc}", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {0})
    LOAD_CPU[0] = args.load_cpu
    if args.poll_ms:
        from tracejoin.pipeline import stages

        stages.POLL_MS = args.poll_ms  # the read loop reads it when it starts
    if args.gc:
        gc.freeze()
        gc.set_threshold(100_000, 50, 50)
    (port,) = m.free_ports(1)
    with contextlib.ExitStack() as stack:
        stack.enter_context(m.go_server(port, 1))
        sink = stack.enter_context(m.otlp_sink(0)) if args.destination == "otlp" else None
        policy = {
            "unsampled": args.unsampled,
            "kernel_policy": args.kernel_policy == "on",
            "ring": args.ring,
        }
        saved: list[bytes] | None = [] if args.save_records else None
        plain = run_once(
            port, args.rate, args.seconds, False, args.batch_ms, sink, **policy, saved=saved
        )
        if args.save_records and saved is not None:
            from bench.stages import save_records

            save_records(args.save_records, saved)
            print(f"saved {len(saved):,} records to {args.save_records}")
        print(
            f"unprofiled: {plain['records']:,} records for {plain['requests']:,} requests "
            f"({plain['kept_in_kernel']:,} kept in the kernel, ringbuf_full "
            f"{plain['ringbuf_full']}; {plain['spans_per_record']:.2f} spans per record; "
            f"{plain['batches']:,} batches, {plain['records'] / max(1, plain['batches']):.0f} "
            "records each); "
            "CPU µs per record: "
            + (
                ", ".join(
                    f"{k} {v:.1f}"
                    + (f" (source.poll {plain['poll_us_per_record']:.2f})" if k == "reader" else "")
                    for k, v in plain["us_per_record"].items()
                )
                + f"; whole process {plain['process_us_per_record']:.1f}"
                if plain["records"]
                else "no records"
            )
            + f"; whole process per request {plain['process_us_per_request']:.1f}"
        )
        print(
            "  by thread name, CPU µs per record: "
            + ", ".join(
                f"{k} {v:.1f}"
                for k, v in sorted(plain["us_per_record_by_thread"].items(), key=lambda kv: -kv[1])
            )
        )
        if args.no_profile:
            return 0
        prof = run_once(port, args.rate, args.seconds, True, args.batch_ms, sink, **policy)
    print(
        f"profiled:   {prof['records']:,} records; CPU µs per record: "
        + ", ".join(f"{k} {v:.1f}" for k, v in prof["us_per_record"].items())
    )
    for name, p in prof["profiles"].items():
        print(f"\n{name} thread, top {args.top} by own time:")
        print(top(p, args.top, max(1, prof["records"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
