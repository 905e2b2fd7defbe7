"""What `--cuda` costs a process that calls CUDA: ns per probed call, on a tight loop of calls.

    sudo python -m bench.cuda_cost [--calls 20000] [--rounds 5]

No GPU is needed: the CUDA runtime and driver are the test doubles (tests/cuda_stubs, built with
gcc here), whose calls do almost nothing, so what the loop measures is the probes' cost. Each
call is a 64-byte `cudaMemcpy` host to device, which calls `cuMemcpyHtoD_v2` beneath it, as the
real runtime does: three uprobe hits per call (the runtime call's entry and return, the driver
call's entry; bpf/cuda.h says why a driver copy has no return probe).

Phases, each `rounds` times, in this order:
  off        no agent loaded (the baseline)
  empty      an empty BPF program on the same three probe points: what the uprobe mechanism
             itself costs here (a trap per hit), before tracejoin does anything
  in set     tracejoin loaded with --cuda; the loop runs inside an HTTP request (GET /loop), so
             its thread is in the request's work set and every call is summed onto the span
  outside    the same agent; the loop runs in a process serving no request (the early exit:
             one `threads` lookup at each entry, nothing remembered)
  off again  the agent unloaded: the baseline once more, to see drift

Prints the calling thread's CPU ns per call per phase (CLOCK_THREAD_CPUTIME_ID: a uprobe runs in
the thread that hits it, and a busy host's preemption does not inflate it), the difference to
the baseline, the BPF run time of the CUDA programs per call (kernel.bpf_stats_enabled), and the
cost of the request pattern the tests use (cudaMalloc, two copies, a synchronisation, cudaFree:
five runtime calls, each over a driver call). docs/performance.md quotes it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tracejoin.kernel.probes import ProbeConfig

from bench import measure as m
from tests import cuda_stubs
from tests.harness import Agent, free_ports, raw_request

REQUEST_CALLS = 5  # /work: cudaMalloc, cudaMemcpy x2, cudaStreamSynchronize, cudaFree


def in_request(port: int, calls: int) -> float:
    """ns per call of a loop inside one request (the server measures it)."""
    resp = raw_request(port, f"GET /loop?n={calls} HTTP/1.1\r\nHost: b\r\n\r\n".encode())
    return float(resp.split(b"\r\n\r\n", 1)[1])


def outside(server: Path, calls: int) -> float:
    out = subprocess.run([str(server), "loop", str(calls)], capture_output=True, text=True)
    return float(out.stdout)


def empty_probes(stubs: cuda_stubs.Stubs, port: int, calls: int, rounds: int) -> list[float]:
    from bcc import BPF

    b = BPF(text=b"int empty(struct pt_regs *ctx) { return 0; }")
    try:
        rt, drv = str(stubs.runtime).encode(), str(stubs.driver).encode()
        b.attach_uprobe(name=rt, sym=b"cudaMemcpy", fn_name=b"empty")
        b.attach_uretprobe(name=rt, sym=b"cudaMemcpy", fn_name=b"empty")
        b.attach_uprobe(name=drv, sym=b"cuMemcpyHtoD_v2", fn_name=b"empty")
        return [in_request(port, calls) for _ in range(rounds)]
    finally:
        b.cleanup()


def phase(name: str, samples: list[float]) -> float:
    med = statistics.median(samples)
    print(f"  {name:<26} {med:8.1f} ns/call  [{min(samples):.1f}..{max(samples):.1f}]")
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=20000, help="calls per loop")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    stubs = cuda_stubs.build(Path(tempfile.mkdtemp(prefix="tj-cuda-bench-")))
    (port,) = free_ports(1)
    server = subprocess.Popen(
        [str(stubs.shared_server), str(port)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and "ready" in server.stdout.readline()
    res: dict[str, float] = {}
    stats = m.BpfStatsSwitch()
    try:
        print(f"{args.calls} x 64-byte cudaMemcpy per loop, {args.rounds} rounds per phase")
        res["off"] = phase(
            "off: in a request", [in_request(port, args.calls) for _ in range(args.rounds)]
        )
        res["off_out"] = phase(
            "off: no request",
            [outside(stubs.shared_server, args.calls) for _ in range(args.rounds)],
        )
        res["empty"] = phase(
            "empty uprobes: in a request", empty_probes(stubs, port, args.calls, args.rounds)
        )
        t0 = time.monotonic()
        agent = Agent([port], None, ProbeConfig(ports=(port,), cuda=True))
        agent.start()
        print(f"  (agent loaded in {time.monotonic() - t0:.1f} s)")
        try:
            in_request(port, 1)  # the agent sees the server serve: it rescans it
            cuda = agent.source.cuda
            assert cuda is not None
            deadline = time.monotonic() + 20
            while not any(server.pid in f.pids and f.attached for f in cuda.files()):
                assert time.monotonic() < deadline, "the stub libraries were never attached"
                time.sleep(0.1)
            time.sleep(1.5)  # the next rescan attaches the rest
            print("  probed:", ", ".join(f"{Path(f.path).name} {f.state}" for f in cuda.files()))
            own = m.own_prog_ids(os.getpid())
            stats.on()
            before = m.prog_stats(own)
            nested0 = agent.source.kernel_counters()["cuda_nested"]
            samples = [in_request(port, args.calls) for _ in range(args.rounds)]
            after = m.prog_stats(own)
            nested = agent.source.kernel_counters()["cuda_nested"] - nested0
            res["on"] = phase("on: in a request", samples)
            res["on_out"] = phase(
                "on: no request",
                [outside(stubs.shared_server, args.calls) for _ in range(args.rounds)],
            )
            stats.restore()
            calls = args.calls * args.rounds
            bpf = {
                after[i]["name"]: (
                    after[i]["run_time_ns"] - before[i]["run_time_ns"],
                    after[i]["run_cnt"] - before[i]["run_cnt"],
                )
                for i in after
                if i in before and after[i]["name"].startswith("cuda_")
            }
            spans = [s for s in agent.spans() if s.attributes.get("server.port") == port]
        finally:
            stats.restore()
            agent.shutdown()
        res["off2"] = phase(
            "off again: in a request", [in_request(port, args.calls) for _ in range(args.rounds)]
        )
    finally:
        server.kill()
        server.wait()
    base = (res["off"] + res["off2"]) / 2
    d_in, d_out = res["on"] - base, res["on_out"] - res["off_out"]
    print()
    print(f"the uprobe mechanism alone (3 empty hits): +{res['empty'] - base:.0f} ns per call")
    print(f"per probed runtime call (with its driver call beneath): +{d_in:.0f} ns in a request's")
    print(f"work set, +{d_out:.0f} ns in a thread in no work set")
    print("BPF run time in the request loop (kernel.bpf_stats_enabled):")
    for name, (ns, cnt) in sorted(bpf.items(), key=lambda kv: -kv[1][0]):
        if cnt:
            per_call, runs = ns / calls, cnt / calls
            print(
                f"  {name:<12} {per_call:7.0f} ns/call  {runs:.2f} runs/call {ns / cnt:6.0f} ns/run"
            )
    print(f"  nested (driver beneath runtime, not counted again): {nested / calls:.2f} per call")
    if spans:
        a = spans[-1].attributes
        print(f"  last loop request's span: memcpy.count {a.get('tracejoin.cuda.memcpy.count')}")
    print(
        f"the /work request pattern ({REQUEST_CALLS} runtime calls over the driver): "
        f"+{REQUEST_CALLS * d_in / 1000:.1f} µs per request"
    )


if __name__ == "__main__":
    if sys.platform != "linux":
        sys.exit("Linux only")
    main()
