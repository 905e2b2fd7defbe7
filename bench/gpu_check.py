"""GPU check: the real NVML sampler and join against known GPU work. Needs a GPU and PyTorch.

    python -m bench.gpu_check [--seconds 2.0] [--requests 3]

Starts the real GpuSampler, serves HTTP in-process, and for each request runs either a
compute-bound phase (A: a bf16/fp16 matmul loop) or a memory-bound phase (B: a device-to-device
copy loop). Each request's server-side window is joined to the samples with the production
join, then checked: A shows a high kernel-active ratio, B a high memory-controller busy ratio,
higher than A's. Also prints NVML's cost per call, per sample and per join.

Prints a PASS/FAIL table and exits 1 on any FAIL; prints "SKIP: <reason>" and exits 0 without
a GPU, NVML or PyTorch. Needs nothing from tracejoin's BPF side and downloads nothing.

    sudo python -m bench.gpu_check --cuda [--mib 64] [--requests 3]

adds the CUDA-calls check (docs/attributes.md "CUDA"; root: it loads tracejoin's probes with
--cuda). A PyTorch server in its own process copies a pageable host tensor of a known size to the
GPU, runs a matmul on it and calls torch.cuda.synchronize() per request, timing its own work with
torch.cuda events and the host clock. Each request's span must show the tensor's bytes host to
device and a synchronisation wait covering the timed synchronize(). It lists the CUDA libraries
found (where the wheels put libcudart: docs/gpu.md) and the per-call cost on the real libraries
(a loop of cudaStreamSynchronize on an idle stream, thread CPU time, before and after the probes
attach).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tracejoin.core import gpu as gj
from tracejoin.core.metrics import Metrics
from tracejoin.enrich.gpu_sampler import GpuSampler, probe_nvml

KERNEL_ACTIVE_MIN_A = 0.80  # compute phase: kernels run nearly all the time
MEM_BUSY_MIN_B = 0.50  # copy phase: device memory is read/written most of the time
COVERAGE_MIN = 0.90  # samples must cover the request windows


@dataclass(frozen=True, slots=True)
class CallCost:
    function: str
    calls: int
    mean_us: float
    p50_us: float
    p99_us: float


def _percentile(sorted_values: list[float], q: float) -> float:
    i = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[i]


def _cost(function: str, times_ns: list[int]) -> CallCost:
    us = sorted(t / 1000 for t in times_ns)
    return CallCost(
        function, len(us), statistics.fmean(us), _percentile(us, 0.5), _percentile(us, 0.99)
    )


def measure_nvml_call_costs(
    nvml: Any = None, repeats: int = 200, device_index: int = 0
) -> list[CallCost]:
    """Time each NVML call the sampler makes, `repeats` times on one device.

    For bench drivers: opens and closes NVML itself. A call that fails (e.g. NOT_SUPPORTED)
    is still timed: the sampler pays for it once. nvmlDeviceGetPcieThroughput measures for
    ~20 ms by design, so it gets at most 10 repeats.
    """
    if nvml is None:
        import pynvml

        nvml = pynvml
    nvml.nvmlInit()
    try:
        h = nvml.nvmlDeviceGetHandleByIndex(device_index)
        since_us = (time.time_ns() // 1000) - 1_000_000
        calls: list[tuple[str, Any, tuple[Any, ...], int]] = [
            ("nvmlDeviceGetUtilizationRates", nvml.nvmlDeviceGetUtilizationRates, (h,), repeats),
            (
                "nvmlDeviceGetSamples(gpu)",
                nvml.nvmlDeviceGetSamples,
                (h, nvml.NVML_GPU_UTILIZATION_SAMPLES, since_us),
                repeats,
            ),
            (
                "nvmlDeviceGetSamples(memory)",
                nvml.nvmlDeviceGetSamples,
                (h, nvml.NVML_MEMORY_UTILIZATION_SAMPLES, since_us),
                repeats,
            ),
            ("nvmlDeviceGetMemoryInfo", nvml.nvmlDeviceGetMemoryInfo, (h,), repeats),
            (
                "nvmlDeviceGetClockInfo(sm)",
                nvml.nvmlDeviceGetClockInfo,
                (h, nvml.NVML_CLOCK_SM),
                repeats,
            ),
            ("nvmlDeviceGetPowerUsage", nvml.nvmlDeviceGetPowerUsage, (h,), repeats),
            (
                "nvmlDeviceGetTemperature",
                nvml.nvmlDeviceGetTemperature,
                (h, nvml.NVML_TEMPERATURE_GPU),
                repeats,
            ),
            (
                "nvmlDeviceGetCurrentClocksEventReasons",
                nvml.nvmlDeviceGetCurrentClocksEventReasons,
                (h,),
                repeats,
            ),
            (
                "nvmlDeviceGetComputeRunningProcesses",
                nvml.nvmlDeviceGetComputeRunningProcesses,
                (h,),
                repeats,
            ),
            (
                "nvmlDeviceGetGraphicsRunningProcesses",
                nvml.nvmlDeviceGetGraphicsRunningProcesses,
                (h,),
                repeats,
            ),
            (
                "nvmlDeviceGetProcessUtilization",
                nvml.nvmlDeviceGetProcessUtilization,
                (h, since_us),
                repeats,
            ),
            (
                "nvmlDeviceGetPcieThroughput(rx)",
                nvml.nvmlDeviceGetPcieThroughput,
                (h, nvml.NVML_PCIE_UTIL_RX_BYTES),
                min(repeats, 10),
            ),
        ]
        out = [_time_call(nvml, name, fn, args, n) for name, fn, args, n in calls]
        out.extend(_gpm_costs(nvml, h, repeats))
        return out
    finally:
        nvml.nvmlShutdown()


def _time_call(nvml: Any, name: str, fn: Any, args: tuple[Any, ...], n: int) -> CallCost:
    times = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        # Timed even when it fails: NOT_FOUND ("no new samples") is a normal answer.
        with contextlib.suppress(nvml.NVMLError):
            fn(*args)
        times.append(time.perf_counter_ns() - t0)
    return _cost(name, times)


def _gpm_costs(nvml: Any, h: Any, repeats: int) -> list[CallCost]:
    try:
        if not nvml.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
            return []
    except nvml.NVMLError:
        return []
    a, b = nvml.nvmlGpmSampleAlloc(), nvml.nvmlGpmSampleAlloc()
    try:
        sample_times, metric_times = [], []
        nvml.nvmlGpmSampleGet(h, a)
        q = nvml.c_nvmlGpmMetricsGet_t()
        for i in range(repeats):
            prev, cur = (a, b) if i % 2 == 0 else (b, a)
            t0 = time.perf_counter_ns()
            nvml.nvmlGpmSampleGet(h, cur)
            sample_times.append(time.perf_counter_ns() - t0)
            q.version = nvml.NVML_GPM_METRICS_GET_VERSION
            q.numMetrics = 2
            q.sample1, q.sample2 = prev, cur
            q.metrics[0].metricId = nvml.NVML_GPM_METRIC_SM_UTIL
            q.metrics[1].metricId = nvml.NVML_GPM_METRIC_DRAM_BW_UTIL
            t0 = time.perf_counter_ns()
            with contextlib.suppress(nvml.NVMLError):
                nvml.nvmlGpmMetricsGet(q)
            metric_times.append(time.perf_counter_ns() - t0)
        return [_cost("nvmlGpmSampleGet", sample_times), _cost("nvmlGpmMetricsGet", metric_times)]
    finally:
        nvml.nvmlGpmSampleFree(a)
        nvml.nvmlGpmSampleFree(b)


def measure_sample_cost(sampler: GpuSampler, repeats: int = 50) -> CallCost:
    """Wall time of one sampler tick over all its devices (an opened sampler, no thread)."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        sampler.sample_once()
        times.append(time.perf_counter_ns() - t0)
        time.sleep(0.005)
    return _cost("GpuSampler.sample_once", times)


def skip_reason(nvml: Any = None) -> str | None:
    """Why this check cannot run here, or None."""
    status = probe_nvml(nvml)
    if not status.available:
        return f"NVML unavailable: {status.reason}"
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if not torch.cuda.is_available():
        return "PyTorch sees no CUDA device"
    return None


# ---- the workload ------------------------------------------------------------------------


class Workload:
    """Phase A: matmuls (compute-bound). Phase B: device-to-device copies (memory-bound)."""

    def __init__(self) -> None:
        import torch

        self.torch = torch
        self.dev = torch.device("cuda:0")
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        n = 8192
        self.a = torch.randn(n, n, device=self.dev, dtype=dtype)
        self.b = torch.randn(n, n, device=self.dev, dtype=dtype)
        self.c = torch.empty(n, n, device=self.dev, dtype=dtype)
        free, _ = torch.cuda.mem_get_info(self.dev)
        copy_bytes = min(1 << 30, free // 8)  # 1 GiB, far beyond L2: every copy goes to DRAM
        self.src = torch.empty(copy_bytes // 2, device=self.dev, dtype=torch.float16)
        self.dst = torch.empty_like(self.src)
        self.lock = threading.Lock()  # one phase at a time on the GPU
        self.run("a", 0.3)  # warm up cuBLAS and the copy path outside the measured windows
        self.run("b", 0.3)

    def run(self, phase: str, seconds: float) -> None:
        torch = self.torch
        deadline = time.monotonic() + seconds
        with self.lock:
            while time.monotonic() < deadline:
                for _ in range(10):
                    if phase == "a":
                        torch.mm(self.a, self.b, out=self.c)
                    else:
                        self.dst.copy_(self.src)
                torch.cuda.synchronize(self.dev)


def serve(workload: Workload) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            phase, _, secs = self.path.strip("/").partition("/")
            start_ns = time.time_ns()
            workload.run(phase, float(secs))
            end_ns = time.time_ns()
            body = json.dumps({"start_ns": start_ns, "end_ns": end_ns}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, name="gpu-check-http", daemon=True).start()
    return server


def request(port: int, phase: str, seconds: float) -> tuple[int, int]:
    url = f"http://127.0.0.1:{port}/{phase}/{seconds}"
    with urllib.request.urlopen(url, timeout=seconds + 60) as resp:
        w = json.loads(resp.read())
    return int(w["start_ns"]), int(w["end_ns"])


# ---- the check ---------------------------------------------------------------------------


@dataclass(slots=True)
class Row:
    check: str
    value: str
    want: str
    result: str  # PASS, FAIL or INFO/WARN (do not fail the run)


def _stat(attrs: dict[str, Any], key: str) -> float:
    v = attrs.get(key)
    return float(v) if isinstance(v, int | float) else float("nan")


def evaluate(a: list[dict[str, Any]], b: list[dict[str, Any]], pid_found: bool) -> list[Row]:
    """PASS/FAIL rows from the joined attributes of phase A and phase B requests."""
    rows = []
    ka = [_stat(x, gj.KERNEL_ACTIVE_AVG) for x in a]
    ma = [_stat(x, gj.MEM_BUSY_AVG) for x in a]
    mb = [_stat(x, gj.MEM_BUSY_AVG) for x in b]
    cov = [_stat(x, gj.WINDOW_COVERAGE) for x in a + b]

    def row(check: str, vals: list[float], want: str, ok: bool) -> None:
        shown = " ".join(f"{v:.2f}" for v in vals)
        rows.append(Row(check, shown, want, "PASS" if ok else "FAIL"))

    # all(...) rather than min(): a missing attribute is NaN, and NaN must fail.
    row(
        "A kernel_active.ratio.avg",
        ka,
        f">= {KERNEL_ACTIVE_MIN_A}",
        _all_at_least(ka, KERNEL_ACTIVE_MIN_A),
    )
    row(
        "B memory_controller_busy.ratio.avg",
        mb,
        f">= {MEM_BUSY_MIN_B}",
        _all_at_least(mb, MEM_BUSY_MIN_B),
    )
    row(
        "B mem busy > A mem busy (means)",
        [statistics.fmean(mb), statistics.fmean(ma)],
        "B > A",
        statistics.fmean(mb) > statistics.fmean(ma),
    )
    row("window.coverage.ratio", cov, f">= {COVERAGE_MIN}", _all_at_least(cov, COVERAGE_MIN))
    rows.append(
        Row(
            "this PID listed by NVML on the GPU",
            "yes" if pid_found else "no",
            "yes",
            "PASS" if pid_found else "WARN",
        )
    )
    for label, key in (
        ("A process.sm_util.ratio.avg", gj.PROCESS_SM_UTIL_AVG),
        ("A gpm.sm_util.ratio.avg", gj.GPM_SM_UTIL_AVG),
        ("B gpm.dram_bw_util.ratio.avg", gj.GPM_DRAM_BW_AVG),
    ):
        src = a if label.startswith("A") else b
        if any(key in x for x in src):
            shown = " ".join(f"{_stat(x, key):.2f}" for x in src)
            rows.append(Row(label, shown, "-", "INFO"))
    reasons = sorted({str(x.get(gj.CLOCK_EVENT_REASONS, "?")) for x in a + b})
    rows.append(Row("clock_event_reasons seen", " | ".join(reasons), "-", "INFO"))
    return rows


def _all_at_least(values: list[float], floor: float) -> bool:
    return bool(values) and all(v >= floor for v in values)


def print_table(rows: list[Row]) -> None:
    w = max(len(r.check) for r in rows)
    v = max(len(r.value) for r in rows)
    print(f"{'check':<{w}}  {'value':<{v}}  {'want':<10}  result")
    for r in rows:
        print(f"{r.check:<{w}}  {r.value:<{v}}  {r.want:<10}  {r.result}")


def print_costs(costs: list[CallCost]) -> None:
    w = max(len(c.function) for c in costs)
    print(f"{'NVML call':<{w}}  {'calls':>6}  {'mean µs':>9}  {'p50 µs':>9}  {'p99 µs':>9}")
    for c in costs:
        figures = f"{c.mean_us:>9.1f}  {c.p50_us:>9.1f}  {c.p99_us:>9.1f}"
        print(f"{c.function:<{w}}  {c.calls:>6}  {figures}")


# ---- CUDA calls on the span (--cuda) ---------------------------------------------------------

SYNC_MIN_RATIO = 0.8  # the span's sync wait vs the host-timed synchronize() it brackets
LOOP_CALLS = 2000


def serve_cuda(port: int) -> None:
    """The workload process (`--serve-cuda PORT`): GET /copy?mib=N copies an N MiB pageable
    tensor to the GPU, multiplies on it and synchronises, and answers what it timed itself;
    GET /loop?n=K times K cudaStreamSynchronize calls on an idle stream (thread CPU ns/call)."""
    from http.server import HTTPServer
    from urllib.parse import parse_qs, urlsplit

    import torch

    torch.zeros(1, device="cuda")  # context and libraries loaded before any measured request
    hosts: dict[int, Any] = {}

    def copy(mib: int) -> dict[str, Any]:
        h = hosts.get(mib)
        if h is None:
            h = hosts[mib] = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        d = h.to("cuda")  # pageable: cudaMemcpyAsync, then the copy is waited for
        end.record()
        n = int(d.numel() ** 0.5) or 1
        m = d[: n * n].view(n, n)
        for _ in range(4):
            m = m @ m / n  # work for synchronize() to wait on
        t0 = time.perf_counter_ns()
        torch.cuda.synchronize()
        sync_ns = time.perf_counter_ns() - t0
        return {
            "bytes": h.numel() * h.element_size(),
            "copy_ms": start.elapsed_time(end),
            "sync_ns": sync_ns,
        }

    def loop(k: int) -> dict[str, Any]:
        stream = torch.cuda.current_stream()
        t0 = time.thread_time_ns()
        for _ in range(k):
            stream.synchronize()
        return {"ns_per_call": (time.thread_time_ns() - t0) / max(k, 1)}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            url = urlsplit(self.path)
            q = {k: int(v[0]) for k, v in parse_qs(url.query).items()}
            out = copy(q.get("mib", 64)) if url.path == "/copy" else loop(q.get("n", 1))
            body = json.dumps(out).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    srv = HTTPServer(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    srv.serve_forever()


def _get(port: int, path: str, traceparent: str | None = None) -> dict[str, Any]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if traceparent:
        req.add_header("traceparent", traceparent)
    with urllib.request.urlopen(req, timeout=120) as resp:
        return dict(json.loads(resp.read()))


def cuda_check(mib: int, requests: int) -> list[Row]:
    """The CUDA-calls rows: spans against the workload's own timing, and the per-call cost."""
    import random
    import subprocess

    from tracejoin.kernel.probes import ProbeConfig

    from tests.harness import Agent, free_ports

    (port,) = free_ports(1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.gpu_check", "--serve-cuda", str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    rows: list[Row] = []
    agent = None
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        base = statistics.median(
            _get(port, f"/loop?n={LOOP_CALLS}")["ns_per_call"] for _ in range(5)
        )
        agent = Agent([port], None, ProbeConfig(ports=(port,), cuda=True))
        agent.start()
        cuda = agent.source.cuda
        assert cuda is not None
        _get(port, "/loop?n=1")  # the agent sees the process serve: it rescans it
        deadline = time.monotonic() + 30
        while not any(proc.pid in f.pids and f.attached for f in cuda.files()):
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
        time.sleep(2.0)  # the next rescan attaches the rest
        for f in cuda.files():
            if proc.pid in f.pids:
                rows.append(Row(f"cuda file ({f.kind})", f.path, "-", "INFO"))
                rows.append(Row("  state", f.state, "probed", "PASS" if f.probes else "FAIL"))
        probed = statistics.median(
            _get(port, f"/loop?n={LOOP_CALLS}")["ns_per_call"] for _ in range(5)
        )
        rows.append(
            Row(
                "cudaStreamSynchronize (idle) ns/call",
                f"{base:.0f} off, {probed:.0f} on (+{probed - base:.0f})",
                "-",
                "INFO",
            )
        )
        for _ in range(requests):
            trace_id = random.getrandbits(128) | 1
            tp = f"00-{trace_id:032x}-{random.getrandbits(64) | 1:016x}-01"
            own = _get(port, f"/copy?mib={mib}", tp)
            (span,) = agent.server_spans(trace_id, timeout_s=20)
            a = span.attributes
            h2d = a.get("tracejoin.cuda.memcpy.bytes.host_to_device", -1)
            rows.append(
                Row(
                    "span h2d bytes vs tensor bytes",
                    f"{h2d} vs {own['bytes']}",
                    ">=",
                    "PASS" if isinstance(h2d, int) and h2d >= own["bytes"] else "FAIL",
                )
            )
            wait = a.get("tracejoin.cuda.sync.wait_ns", -1)
            ok = isinstance(wait, int) and wait >= SYNC_MIN_RATIO * own["sync_ns"]
            rows.append(
                Row(
                    "span sync.wait_ns vs host-timed synchronize()",
                    f"{wait} vs {own['sync_ns']}",
                    f">= {SYNC_MIN_RATIO}x",
                    "PASS" if ok else "FAIL",
                )
            )
            rows.append(
                Row(
                    "  memcpy/sync count; torch copy event ms",
                    f"{a.get('tracejoin.cuda.memcpy.count')}/"
                    f"{a.get('tracejoin.cuda.sync.count')}; {own['copy_ms']:.3f}",
                    "-",
                    "INFO",
                )
            )
        nested = agent.source.kernel_counters().get("cuda_nested", 0)
        rows.append(Row("calls nested under another (counted once)", str(nested), "-", "INFO"))
    finally:
        if agent is not None:
            agent.shutdown()
        proc.kill()
        proc.wait()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="GPU work per request")
    ap.add_argument("--requests", type=int, default=3, help="requests per phase")
    ap.add_argument("--cuda", action="store_true", help="also check CUDA calls on spans (root)")
    ap.add_argument("--mib", type=int, default=64, help="--cuda: tensor size per request")
    ap.add_argument("--serve-cuda", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_cuda:
        serve_cuda(args.serve_cuda)
        return 0

    reason = skip_reason()
    if reason:
        print(f"SKIP: {reason}")
        return 0
    import torch

    metrics = Metrics()
    sampler = GpuSampler(metrics)
    status = sampler.start()
    if not status.available:  # probed fine a moment ago; report rather than guess
        print(f"SKIP: NVML unavailable: {status.reason}")
        return 0
    server = None
    try:
        print(status.describe())
        print(f"torch {torch.__version__}, CUDA device: {torch.cuda.get_device_name(0)}")
        workload = Workload()
        server = serve(workload)
        port = server.server_address[1]
        time.sleep(1.0)  # idle gap: phase A windows must not include the warm-up
        windows_a = [request(port, "a", args.seconds) for _ in range(args.requests)]
        time.sleep(1.0)
        windows_b = [request(port, "b", args.seconds) for _ in range(args.requests)]
        last_end = windows_b[-1][1]
        deadline = time.monotonic() + 5
        while sampler.covered_until_ns() < last_end and time.monotonic() < deadline:
            time.sleep(0.05)

        pid = os.getpid()
        pid_found = all(sampler.join_windows(pid, s, e) for s, e in windows_a)
        # NVML lists host PIDs; inside a container without the host PID namespace our PID is
        # not among them. Then judge the device-wide figures (pid None) and say so.
        join_pid = pid if pid_found else None
        attrs_a = [gj.span_attributes(sampler.join_windows(join_pid, s, e)) for s, e in windows_a]
        attrs_b = [gj.span_attributes(sampler.join_windows(join_pid, s, e)) for s, e in windows_b]
        rows = evaluate(attrs_a, attrs_b, pid_found)

        s, e = windows_a[0]
        join_times = []
        for _ in range(1000):
            t0 = time.perf_counter_ns()
            sampler.join(pid, s, e)
            join_times.append(time.perf_counter_ns() - t0)
    finally:
        if server is not None:
            server.shutdown()
        sampler.shutdown()

    print()
    print_table(rows)
    print()
    costs = measure_nvml_call_costs()
    tick_sampler = GpuSampler(Metrics(), pcie_interval_s=3600)
    tick_sampler.open()
    tick_sampler.sample_once()  # reads PCIe once; the timed ticks below do not
    tick = measure_sample_cost(tick_sampler)
    tick_sampler.shutdown()
    print_costs([*costs, tick, _cost("GpuSampler.join (per span)", join_times)])
    print(f"(sample_once covers {len(status.gpus)} GPU(s) without PCIe; PCIe cost as listed)")
    if args.cuda:
        cuda_rows = cuda_check(args.mib, args.requests)
        print()
        print_table(cuda_rows)
        rows += cuda_rows
    failed = [r for r in rows if r.result == "FAIL"]
    print()
    print("RESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
