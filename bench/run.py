"""tracejoin's benchmark suite: one command, every figure side by side from the same run.

    sudo make bench                        # = python -m bench.run   (~6-7 min)
    sudo python -m bench.run --quick       # ~2-3 min, fewer and shorter phases

1. Overhead on the traced server. The Go net/http test server (pinned to CPU1) serves `/` (a
   µs handler) and `/sleep?ms=5` (a ms handler) under wrk at saturation (closed loop) and under
   bench/loadgen at half of saturation (open loop, constant rate, latency from each request's
   due time). Agent-off and agent-on phases alternate (>= 3 of each); each "on" phase runs the
   real `tracejoin run` (BCC probes -> ring buffer -> spans -> OTLP/HTTP protobuf to a local
   sink that discards, or with --destination file OTLP-JSON on tmpfs) as its own process,
   pinned to CPU0 with the load generator (2 CPUs: see docs/performance.md); variants: the
   probes attached with the agent stopped (kernel cost alone), and the agent on the server's
   CPU. Also an unrelated process's read/write/getppid cost, with and without the probes.
   The agents' CPU budget is off (--cpu-budget to change it): every request is traced.
2. Agent cost: CPU per traced request, peak RSS, start-up to ready, BPF ns per program hit
   (kernel.bpf_stats_enabled on only during the loss curve, then restored), records per request.
3. Loss curve: offered requests/s vs records delivered and lost (kernel and user space).
4. Export throughput (bench.export_throughput, tracejoin's encoder vs the OTel SDK).
5. GPU sampler cost per NVML call and per sample (bench.gpu_check), when NVML is present.

Prints a table with each target's PASS/MISS and writes bench/results/<timestamp>.json.
Needs root (BPF), wrk, bpftool, taskset and Go (it builds bench/loadgen and the test server).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import measure as m

RESULTS = Path(__file__).parent / "results"


@dataclass(frozen=True)
class Config:
    rounds: int = 3  # off/on pairs
    phase_s: int = 5  # each load phase (wrk takes whole seconds)
    warmup_s: float = 0.5  # open-loop load before its measured window
    calib_s: int = 3
    syscall_calls: int = 500_000
    syscall_rounds: int = 5
    loss_rates: tuple[int, ...] = (500, 1000, 2000, 5000, 10000, 20000)
    loss_s: int = 5
    export_spans: int = 10_000
    export_repeat: int = 3
    fast_conns: int = 32  # wrk, `/`
    slow_conns: int = 64  # wrk, `/sleep?ms=5`: at most 64 / 5 ms = 12.8k req/s
    rate_conns_fast: int = 16
    rate_conns_slow: int = 96
    slow_ms: int = 5
    server_cpu: int | None = 1
    load_cpu: int | None = 0
    agent_cpu: int | None = 0
    syscall_cpu: int | None = 1  # the server's CPU, idle while the syscall loop runs
    # The load generator outranks the agent on their shared CPU, so that what is measured is
    # the server (and the kernel work the probes add to it), not a starved load generator.
    load_nice: int = -10
    kernel_phase: bool = True  # also: probes attached, agent process stopped
    shared_phase: bool = True  # also: the agent moved onto the server's CPU
    destination: str = "otlp"  # "otlp": OTLP/HTTP protobuf to bench/otlp_sink; "file": JSON
    # The agents run with the CPU budget off: the targets are the cost of tracing every request,
    # and a budget sheds instead of paying it (bench.overload measures the budget itself).
    # --cpu-budget 0.5 measures the agent as deployed.
    cpu_budget: str = "0"


QUICK = Config(
    rounds=3,
    phase_s=2,
    warmup_s=0.3,
    calib_s=2,
    syscall_calls=100_000,
    syscall_rounds=3,
    shared_phase=False,
    loss_rates=(1000, 5000, 20000),
    loss_s=2,
    export_spans=3_000,
    export_repeat=2,
)


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    kind: str  # "wrk", "rate" or "syscall"
    path: str = "/"
    base: str = ""  # the scenario whose load (and agent-off phases) this one shares

    @property
    def load_key(self) -> str:
        return self.base or self.key


def scenarios(cfg: Config) -> list[Scenario]:
    slow = f"/sleep?ms={cfg.slow_ms}"
    return [
        Scenario("fast_sat", f"Go / (µs), wrk c{cfg.fast_conns}, saturation", "wrk", "/"),
        Scenario("fast_half", "Go / (µs), open loop at 1/2 saturation", "rate", "/"),
        Scenario("slow_sat", f"Go {slow}, wrk c{cfg.slow_conns}, saturation", "wrk", slow),
        Scenario("slow_half", f"Go {slow}, open loop at 1/2 sat.", "rate", slow),
        Scenario("syscalls", "unrelated process: syscall loop", "syscall"),
    ]


VARIANT_BASES = ("fast_sat", "fast_half", "slow_half")


def _variants(cfg: Config, suffix: str, label: str) -> list[Scenario]:
    base = {sc.key: sc for sc in scenarios(cfg)}
    return [
        Scenario(f"{k}_{suffix}", f"  same, {label}", base[k].kind, base[k].path, k)
        for k in VARIANT_BASES
    ]


def kernel_scenarios(cfg: Config) -> list[Scenario]:
    """The probes attached but the agent process stopped (SIGSTOP): the kernel side alone."""
    return _variants(cfg, "kernel", "probes only (agent SIGSTOPped)") if cfg.kernel_phase else []


def shared_scenarios(cfg: Config) -> list[Scenario]:
    """The agent on the server's CPU: what a saturated host pays for the agent's own CPU."""
    if not cfg.shared_phase or cfg.server_cpu is None:
        return []
    return _variants(cfg, "shared", "agent on the server's CPU")


def all_scenarios(cfg: Config) -> list[Scenario]:
    """Report order: each scenario, then its variants."""
    out = []
    variants = kernel_scenarios(cfg) + shared_scenarios(cfg)
    for sc in scenarios(cfg):
        out.append(sc)
        out.extend(v for v in variants if v.base == sc.key)
    return out


# ------------------------------------------------------------------------------ running


class Bench:
    def __init__(self, cfg: Config, log: Callable[[str], None]) -> None:
        self.cfg = cfg
        self.log = log
        (self.port,) = m.free_ports(1)
        self.server_pid = 0
        self.rates: dict[str, float] = {}
        self.phases: list[dict[str, Any]] = []
        self.agents: list[dict[str, Any]] = []
        self.loss: list[dict[str, Any]] = []
        self.bpf: dict[str, Any] = {}
        self.stats_switch = m.BpfStatsSwitch()
        self.sink_port: int | None = None
        # the run's own cache of compiled probes: its first agent compiles (a first start on a
        # node), the later ones load what it kept (every start after that)
        import tempfile

        self.bpf_cache = Path(tempfile.mkdtemp(prefix="tjbench-bpf-"))

    def load(self, sc: Scenario, seconds: float) -> dict[str, Any]:
        cfg = self.cfg
        key = sc.load_key
        if sc.kind == "wrk":
            conns = cfg.fast_conns if key.startswith("fast") else cfg.slow_conns
            return m.wrk(self.port, sc.path, conns, int(seconds), cfg.load_cpu, cfg.load_nice)
        if sc.kind == "rate":
            conns = cfg.rate_conns_fast if key.startswith("fast") else cfg.rate_conns_slow
            rps = self.rates[key]
            return m.rate(
                self.port, sc.path, rps, seconds, conns, cfg.load_cpu, cfg.warmup_s, cfg.load_nice
            )
        return m.syscalls(cfg.syscall_calls, cfg.syscall_rounds, cfg.syscall_cpu)

    def calibrate(self) -> None:
        """Saturation throughput with the agent off sets the open-loop rates (1/2 of it)."""
        for key, sat in (("fast_half", "fast_sat"), ("slow_half", "slow_sat")):
            sc = next(s for s in scenarios(self.cfg) if s.key == sat)
            r = self.load(sc, self.cfg.calib_s)
            self.rates[sat] = r["rps"]
            self.rates[key] = round(r["rps"] / 2)
            self.log(f"  calibration {sat}: {r['rps']:,.0f} req/s -> {key} at {self.rates[key]:,}")

    def phase(
        self,
        rnd: int,
        agent: m.AgentRun | None,
        scs: list[Scenario],
        probes_only: m.AgentRun | None = None,
    ) -> None:
        """Run each scenario once. `agent`: a running agent, measured; `probes_only`: a
        stopped one (its programs stay attached; nothing reads the ring buffer)."""
        holder = agent or probes_only
        own = holder.prog_ids if holder is not None else set()
        for sc in scs:
            rec: dict[str, Any] = {
                "round": rnd,
                "agent": agent is not None or probes_only is not None,
                "scenario": sc.key,
            }
            rec["foreign_bpf_progs"] = m.foreign_tracing_progs(own)
            before = agent.metrics() if agent else {}
            a_cpu0 = agent.cpu_split() if agent else m.Cpu(0.0, 0.0, 0.0)
            s_cpu0 = sum(m.cpu_seconds(self.server_pid))
            mine = {self.server_pid}  # and every child of this process (m.other_cpu_seconds)
            procs0 = m.process_cpu_table()
            j0 = m.cpu_jiffies()
            t0 = time.monotonic()
            rec["load"] = self.load(sc, self.cfg.phase_s)
            wall = time.monotonic() - t0
            if sc.kind == "syscall" and holder is None:
                # the floor, in the same run: the same syscalls under empty programs on the
                # probed tracepoints (the tracepoint dispatch and BPF entry alone)
                rec["load_empty"] = empty_programs_syscalls(self.cfg)
            j1 = m.cpu_jiffies()
            procs1 = m.process_cpu_table()
            s_cpu1 = sum(m.cpu_seconds(self.server_pid))
            # other people's processes on this machine during the phase (fraction of one CPU)
            rec["other_cpu"] = round(m.other_cpu_seconds(procs0, procs1, mine) / wall, 3)
            rec["cpu_busy"] = m.busy_fraction(j0, j1)
            if sc.kind == "rate":
                # an open loop that could not send on time measured a queue, not the server;
                # and one whose requests were not all answered inside the window measured a
                # server (or CPU) that fell behind: both are flagged `!`
                ld = rec["load"]
                rec["generator_behind"] = (
                    ld["send_lag_us"]["p50"] > 1000
                    or ld.get("incomplete", 0) > 0
                    or ld.get("completed_in_window", ld["scheduled"]) < 0.99 * ld["scheduled"]
                )
            if sc.kind != "syscall":
                done = rec["load"]["requests_total"]
                rec["server_cpu_us_per_req"] = (s_cpu1 - s_cpu0) * 1e6 / max(1, done)
            if agent:
                after = agent.wait_drained(before)
                a_cpu1 = agent.cpu_split()
                d = m.delta(before, after)
                rec["agent_cost"] = agent_delta(d, a_cpu0, a_cpu1)
            else:
                time.sleep(0.5)  # the same pause the drain wait gives the "on" phases
            self.phases.append(rec)
            self.log("  " + phase_line(rec))

    def start_agent(self) -> m.AgentRun:
        budget = ["--cpu-budget", self.cfg.cpu_budget]
        agent = m.AgentRun(
            [self.port],
            self.cfg.agent_cpu,
            self.sink_port,
            extra_args=budget,
            bpf_cache=self.bpf_cache,
        )
        agent.start()
        how = (
            f"compiled in child processes in {agent.compile_s:.1f} s, "
            f"peaks {agent.compile_peak_mb:.0f} MB summed"
            if agent.bpf_source == "compiled"
            else "compiled programs from the cache"
        )
        self.log(
            f"  agent ready in {agent.startup_s:.2f} s (probes {agent.load_s:.1f} s: {how}); "
            f"HTTP/2 on at {agent.http2_s:.2f} s"
        )
        return agent

    def stop_agent(self, agent: m.AgentRun) -> None:
        agent.stop()
        self.agents.append(
            {
                "startup_s": round(agent.startup_s, 3),
                "probe_load_s": agent.load_s,
                "bpf_source": agent.bpf_source,
                "compile_s": round(agent.compile_s, 3),
                "compile_peak_mb": agent.compile_peak_mb,
                "http2_s": round(agent.http2_s, 3),
                "scheduler": agent.scheduler,
                "stop_s": round(agent.stop_s, 3),
                "peak_rss_mb": round(agent.peak_rss_kb / 1024, 1),
                "rss_at_stop_mb": {k: round(v / 1024, 1) for k, v in agent.rss_kb.items()},
            }
        )

    def loss_curve(self) -> None:
        """Offered rate vs records delivered/lost, one agent, BPF run-time stats on. Then the
        unrelated syscall loop once more, to split its extra cost by program."""
        cfg = self.cfg
        agent = self.start_agent()
        try:
            self.stats_switch.on()
            p0 = m.prog_stats(agent.prog_ids)
            steps: list[tuple[str, float]] = [
                ("rate", r) for r in cfg.loss_rates if r < 0.9 * self.rates["fast_sat"]
            ]
            steps.append(("wrk", 0.0))
            total_requests = 0
            for kind, rps in steps:
                before = agent.metrics()
                c0 = agent.cpu_split()
                ps0 = m.prog_stats(agent.prog_ids)
                if kind == "rate":
                    conns, cpu, nice = cfg.rate_conns_fast, cfg.load_cpu, cfg.load_nice
                    load = m.rate(self.port, "/", rps, cfg.loss_s, conns, cpu, nice=nice)
                else:
                    load = m.wrk(
                        self.port, "/", cfg.fast_conns, cfg.loss_s, cfg.load_cpu, cfg.load_nice
                    )
                requests = load["requests_total"]  # an open loop's warm-up is traced too
                after = agent.wait_drained(before)
                ps1 = m.prog_stats(agent.prog_ids)
                c1 = agent.cpu_split()
                d = m.delta(before, after)
                total_requests += requests
                bpf_ns = sum(ps1[i]["run_time_ns"] - ps0[i]["run_time_ns"] for i in ps1 if i in ps0)
                step = {
                    "offered": "max (wrk)" if kind == "wrk" else rps,
                    "achieved_rps": round(load["rps"]),
                    "requests": requests,
                    **agent_delta(d, c0, c1),
                    "bpf_ns_per_request": round(bpf_ns / max(1, requests)),
                }
                self.loss.append(step)
                self.log("  " + loss_line(step))
            p1 = m.prog_stats(agent.prog_ids)
            self.bpf = m.bpf_table(p0, p1, total_requests)
            # the unrelated process, program by program (its calls, not HTTP requests)
            sys_res = m.syscalls(cfg.syscall_calls, 1, cfg.syscall_cpu)
            p2 = m.prog_stats(agent.prog_ids)
            progs = m.bpf_table(p1, p2, 1)["programs"]
            self.bpf["syscall_loop"] = {
                "calls_each": cfg.syscall_calls,
                "ns_per_call_with_stats": {k: v for k, v in sys_res.items() if k.endswith("_ns")},
                "programs": [
                    {k: p[k] for k in ("name", "hits", "ns_per_hit")}
                    for p in progs
                    if p["hits"] >= cfg.syscall_calls // 2
                ],
            }
        finally:
            self.stats_switch.restore()
            self.stop_agent(agent)


EMPTY_PAIRS = "".join(
    f"TRACEPOINT_PROBE(syscalls, sys_{d}_{c}) {{ return 0; }}\n"
    for c in ("read", "write")
    for d in ("enter", "exit")
)


def empty_programs_syscalls(cfg: Config) -> dict[str, Any]:
    """The unrelated syscall loop with empty programs on sys_enter/exit_read and _write."""
    from bcc import BPF

    bpf = BPF(text=EMPTY_PAIRS.encode())
    try:
        return m.syscalls(cfg.syscall_calls, cfg.syscall_rounds, cfg.syscall_cpu)
    finally:
        bpf.cleanup()


def agent_delta(d: dict[str, float], c0: m.Cpu, c1: m.Cpu) -> dict:
    received = d.get("records_received", 0)
    user, system, on_cpu = c1.user - c0.user, c1.system - c0.system, c1.on_cpu - c0.on_cpu
    lost_user = d.get("records_dropped_userspace", 0)
    return {
        "records_submitted": int(d.get("kernel_records_submitted", 0)),
        "records_received": int(received),
        "lost_kernel_ringbuf_full": int(d.get("kernel_ringbuf_full", 0)),
        "lost_userspace_records": int(lost_user),
        "spans_dropped_export": int(d.get("spans_dropped", 0)),
        "request_state_lost": int(d.get("kernel_request_state_lost", 0)),
        "spans_built": int(d.get("spans_built", 0)),
        "spans_exported": int(d.get("spans_exported", 0)),
        "sampled_out_budget": int(d.get("kernel_sampled_out_budget", 0)),
        "cpu_user_s": round(user, 3),
        "cpu_sys_s": round(system, 3),
        "cpu_s": round(on_cpu, 6),  # user + system to the ns (threads' schedstat)
        "cpu_us_per_record": round(on_cpu * 1e6 / received, 2) if received else None,
        "user_us_per_record": round(user * 1e6 / received, 2) if received else None,
    }


# ------------------------------------------------------------------------------ figures


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _span(xs: list[float]) -> list[float]:
    return [round(min(xs), 4), round(max(xs), 4)] if xs else []


def pairs(phases: list[dict], sc: Scenario) -> list[tuple[dict, dict]]:
    """(off, on) phases of one scenario, round by round."""
    off = {p["round"]: p for p in phases if p["scenario"] == sc.load_key and not p["agent"]}
    on = {p["round"]: p for p in phases if p["scenario"] == sc.key and p["agent"]}
    return [(off[r], on[r]) for r in sorted(off) if r in on]


OTHER_CPU_LIMIT = 0.05  # of one CPU: more than that from other processes disturbs a phase


def _disturbed(p: dict) -> bool:
    return bool(p.get("foreign_bpf_progs")) or p.get("other_cpu", 0) > OTHER_CPU_LIMIT


def overhead(phases: list[dict], sc: Scenario) -> dict[str, Any]:
    every = pairs(phases, sc)
    # Rounds where someone else's tracing programs were loaded (another tracejoin under test,
    # say) or other processes took more than 5% of a CPU measured them too: leave those rounds
    # out while at least one clean round remains.
    clean = [(a, b) for a, b in every if not _disturbed(a) and not _disturbed(b)]
    ps = clean or every
    noise = {"rounds": len(every), "rounds_used": len(ps), "all_disturbed": not clean}
    if sc.kind == "syscall":
        out: dict[str, Any] = {"noise": noise}
        for k in ("read_devzero_ns", "read_pipe_ns", "write_devnull_ns", "getppid_ns"):
            off = [a["load"][k] for a, _ in ps]
            on = [b["load"][k] for _, b in ps]
            deltas = [b - a for a, b in zip(off, on, strict=True)]
            out[k] = {
                "off": round(_mean(off), 1),
                "on": round(_mean(on), 1),
                "delta_ns": round(_mean(deltas), 1),
                "delta_span": _span(deltas),
                "off_span": _span(off),
            }
            empty = [a["load_empty"][k] for a, _ in ps if "load_empty" in a]
            if empty:
                out[k]["empty"] = round(_mean(empty), 1)
                # what tracejoin adds above the dispatch floor (empty programs), same rounds
                over = [b["load"][k] - a["load_empty"][k] for a, b in ps if "load_empty" in a]
                out[k]["over_empty_ns"] = round(_mean(over), 1)
                out[k]["over_empty_span"] = _span(over)
        return out
    rps_off = [a["load"]["rps"] for a, _ in ps]
    rps_on = [b["load"]["rps"] for _, b in ps]
    ratios = [b / a for a, b in zip(rps_off, rps_on, strict=True)]
    out = {
        "noise": noise,
        "rps_off": round(_mean(rps_off)),
        "rps_on": round(_mean(rps_on)),
        "rps_off_span": _span(rps_off),
        "throughput_ratio": round(_mean(rps_on) / _mean(rps_off), 4),
        "throughput_ratio_span": _span(ratios),
    }
    for q in ("p50", "p99"):
        off = [a["load"]["latency_us"][q] for a, _ in ps]
        on = [b["load"]["latency_us"][q] for _, b in ps]
        rel = [(b - a) / a for a, b in zip(off, on, strict=True)]
        out[f"{q}_off_us"] = round(_mean(off), 1)
        out[f"{q}_on_us"] = round(_mean(on), 1)
        out[f"{q}_off_span"] = _span(off)
        out[f"delta_{q}"] = round((_mean(on) - _mean(off)) / _mean(off), 4)
        out[f"delta_{q}_span"] = _span(rel)
    srv_off = [a["server_cpu_us_per_req"] for a, _ in ps]
    srv_on = [b["server_cpu_us_per_req"] for _, b in ps]
    out["server_cpu_us_per_req_off"] = round(_mean(srv_off), 2)
    out["server_cpu_us_per_req_on"] = round(_mean(srv_on), 2)
    out["cpu_busy_off"] = {c: round(_mean([a["cpu_busy"][c] for a, _ in ps]), 2) for c in CPUS}
    out["cpu_busy_on"] = {c: round(_mean([b["cpu_busy"][c] for _, b in ps]), 2) for c in CPUS}
    costs = [b["agent_cost"] for _, b in ps if "agent_cost" in b]
    out["agent_cpu_us_per_record"] = _per_record(costs)
    out["phases_generator_behind"] = sum(
        1 for a, b in ps for x in (a, b) if x.get("generator_behind")
    )
    out["records_per_request"] = round(
        sum(b["agent_cost"]["records_submitted"] for _, b in ps if "agent_cost" in b)
        / max(1, sum(b["load"]["requests_total"] for _, b in ps if "agent_cost" in b)),
        3,
    )
    return out


CPUS = ("cpu0", "cpu1")


def _per_span(agents: list[dict]) -> float | None:
    """Agent CPU (user+sys) per span built for export (spans_built: the exporter's 1 s flush
    may not have sent the last ones when the phase's CPU is read, but their CPU is counted)."""
    spans = sum(a.get("spans_built", 0) for a in agents)
    cpu = sum(map(_cpu_s, agents))
    return round(cpu * 1e6 / spans, 2) if spans else None


def _per_record(agents: list[dict]) -> float | None:
    rec = sum(a["records_received"] for a in agents)
    cpu = sum(map(_cpu_s, agents))
    return round(cpu * 1e6 / rec, 2) if rec else None


def _cpu_s(agent_cost: dict) -> float:
    """An agent's user + system seconds in a phase: to the ns where the result has it
    (since 2026-12-03), else from clock ticks."""
    return agent_cost.get("cpu_s", agent_cost["cpu_user_s"] + agent_cost["cpu_sys_s"])


@dataclass
class Target:
    name: str
    want: str
    measured: str
    ok: bool | None  # None: could not be measured

    @property
    def verdict(self) -> str:
        return "n/a" if self.ok is None else ("PASS" if self.ok else "MISS")


def targets(res: dict[str, Any]) -> list[Target]:
    ov = res["overhead"]
    out = []
    for key, label, want in (
        ("fast_sat", "µs-server throughput at saturation, on/off", 0.85),
        ("fast_sat_kernel", "... probes alone (agent stopped)", 0.9),
    ):
        if key in ov:
            r = ov[key]["throughput_ratio"]
            out.append(Target(label, f">= {want}", f"{r:.3f}", r >= want))
    loss_half = 1 - ov["fast_half"]["throughput_ratio"]
    out.append(
        Target(
            "throughput loss, µs server, 1/2 saturation",
            "<= 2%",
            f"{loss_half:+.1%} (ratio {ov['fast_half']['throughput_ratio']:.3f})",
            loss_half <= 0.02,
        )
    )
    for key, label in (("fast_half", "µs server"), ("slow_half", "ms server")):
        d = ov[key]["delta_p99"]
        out.append(
            Target(
                f"Δp99 latency, {label}, 1/2 saturation",
                "<= 10%",
                f"{d:+.1%} ({ov[key]['p99_off_us']:.0f} -> {ov[key]['p99_on_us']:.0f} µs)",
                d <= 0.10,
            )
        )
    # The issue's target holds "at every rate in the loss curve": judged by the worst step. The
    # overhead phases' figure (every rate together, dominated by the saturated phase's many
    # records) is printed with the agent's rows, not judged.
    per_step = [(s["offered"], _per_span([s])) for s in res["loss_curve"] if s.get("spans_built")]
    if per_step:
        rate, worst = max(per_step, key=lambda x: x[1])
        at = f"{rate:,} req/s" if isinstance(rate, int) else rate
        steps = " / ".join(f"{v:.1f}" for _, v in per_step)
        measured = f"{worst:.1f} µs at {at} (steps: {steps})"
    else:
        worst, measured = None, "no spans"
    out.append(
        Target(
            "agent CPU per span (user+sys / spans built), every loss-curve step",
            "<= 10 µs",
            measured,
            None if worst is None else worst <= 10,
        )
    )
    sy = ov["syscalls"]
    over = [
        sy[k]["over_empty_ns"]
        for k in ("read_devzero_ns", "write_devnull_ns")
        if "over_empty_ns" in sy[k]
    ]
    if over:
        out.append(
            Target(
                "unrelated read()/write(): tracejoin − empty programs",
                "<= 50 ns",
                " / ".join(f"{x:+.0f} ns" for x in over),
                max(over) <= 50,
            )
        )
    # Judged on the open-loop steps only (wrk's saturation row is closed loop, above 20k), and
    # only as far as they went: a run whose open-loop steps stopped below 20k req/s (a quick
    # run, or a server that saturates below ~22k) cannot say "no loss up to 20k".
    open_loop = [
        s for s in res["loss_curve"] if isinstance(s["offered"], int) and s["offered"] <= 20_000
    ]
    lost = [s for s in open_loop if s["lost_kernel_ringbuf_full"] or s["lost_userspace"]]
    clean = [s["achieved_rps"] for s in open_loop if s not in lost]
    top_offered = max((s["offered"] for s in open_loop), default=0)
    shed = sum(s.get("sampled_out_budget", 0) for s in open_loop)
    if lost:
        measured = (
            f"lost from {lost[0]['achieved_rps']:,} req/s "
            f"({lost[-1]['lost_fraction']:.0%} at the top); "
            f"clean up to {max(clean, default=0):,} req/s"
        )
    elif top_offered >= 20_000:
        measured = "0 lost"
    elif not open_loop:
        measured = "no open-loop step in this run"
    else:
        measured = f"0 lost up to {top_offered:,} req/s, the top open-loop step of this run"
    if shed:  # not a loss (the budget's, by trace id, counted apart), but never hidden
        measured += f"; {shed:,} shed by the budget, counted apart"
    out.append(
        Target(
            "no records lost up to 20k req/s open loop",
            "0 lost",
            measured,
            False if lost else (True if top_offered >= 20_000 else None),
        )
    )
    # the path `tracejoin run` takes: the object-free encoder when the result has it (older
    # results only measured the object path)
    ratio = res["export"].get("ratio_encoded_path") or res["export"].get("ratio")
    out.append(
        Target(
            "export path spans/CPU-s vs OTel SDK (the path tracejoin run takes)",
            ">= 4x",
            f"{ratio:.2f}x" if ratio else "not run",
            None if ratio is None else ratio >= 4,
        )
    )
    # results from before the compile cache compiled at every start
    runs = res["agent"]["runs"]
    for label, source in (
        ("start-up to ready, first on a kernel: compiles (worst run)", "compiled"),
        ("start-up to ready, compiled programs cached (worst run)", "cache"),
    ):
        starts = [a["startup_s"] for a in runs if a.get("bpf_source", "compiled") == source]
        worst = max(starts, default=None)
        out.append(
            Target(
                label,
                "<= 2 s",
                "no such start in this run" if worst is None else f"{worst:.2f} s",
                None if worst is None else worst <= 2,
            )
        )
    rss = max(a["peak_rss_mb"] for a in runs)
    out.append(Target("agent peak RSS (worst run)", "<= 120 MB", f"{rss:.0f} MB", rss <= 120))
    return out


# ------------------------------------------------------------------------------ printing


def phase_line(p: dict) -> str:
    tag = f"r{p['round']} {'on ' if p['agent'] else 'off'} {p['scenario']:<16}"
    ld = p["load"]
    if p["scenario"] == "syscalls":
        return (
            f"{tag} read(/dev/zero) {ld['read_devzero_ns']:.0f} ns, read(pipe) "
            f"{ld['read_pipe_ns']:.0f} ns, write(/dev/null) {ld['write_devnull_ns']:.0f} ns, "
            f"getppid {ld['getppid_ns']:.0f} ns"
        )
    s = (
        f"{tag} {ld['rps']:>9,.0f} req/s  p50 {ld['latency_us']['p50']:>7.0f} µs  p99 "
        f"{ld['latency_us']['p99']:>7.0f} µs  cpu0 {p['cpu_busy'].get('cpu0', 0):.0%} "
        f"cpu1 {p['cpu_busy'].get('cpu1', 0):.0%}"
    )
    if p.get("agent_cost"):
        a = p["agent_cost"]
        s += (
            f"  agent {a['records_received']:,} rec, {a['cpu_us_per_record'] or 0:.1f} µs/rec, "
            f"ringbuf_full {a['lost_kernel_ringbuf_full']:,}"
        )
    if p["foreign_bpf_progs"]:
        s += f"  [{p['foreign_bpf_progs']} foreign BPF progs]"
    if p.get("other_cpu", 0) > OTHER_CPU_LIMIT:
        s += f"  [other processes: {p['other_cpu']:.0%} of a CPU]"
    return s


def loss_line(s: dict) -> str:
    return (
        f"offered {s['offered']!s:>9}  achieved {s['achieved_rps']:>7,}  requests "
        f"{s['requests']:>8,}  submitted {s['records_submitted']:>8,}  delivered "
        f"{s['records_received']:>8,}  ringbuf_full {s['lost_kernel_ringbuf_full']:>7,}  "
        f"user drops {s['lost_userspace_records']:,}  "
        f"shed by the budget {s.get('sampled_out_budget', 0):,}"
    )


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _spanpct(xs: list[float]) -> str:
    return f"[{xs[0]:+.1%}..{xs[1]:+.1%}]" if xs else ""


def format_report(res: dict[str, Any]) -> str:
    L: list[str] = []
    cfg = res["config"]
    L.append(
        f"tracejoin bench {res['started']}  ({res['mode']}: {cfg['rounds']} off/on rounds, "
        f"{cfg['phase_s']} s phases; {res['wall_s']:.0f} s in all)"
    )
    mach = res["machine"]
    L.append(
        f"machine: {mach['cpu_model']}, {mach['cpus']} vCPU ({mach['hypervisor']}), "
        f"kernel {mach['kernel']}, Python {mach['python']}; server CPU{cfg['server_cpu']}, "
        f"load generator CPU{cfg['load_cpu']}, agent CPU{cfg['agent_cpu']}"
    )
    noise = res["noise"]
    L.append(
        f"noise: load average at start {noise['loadavg_start']}; phases disturbed (foreign "
        f"tracing BPF programs, or other processes > {OTHER_CPU_LIMIT:.0%} of a CPU): "
        f"{noise.get('phases_disturbed', '?')}/{noise['phases']}"
    )
    L.append("")
    L.append("1. Overhead on the traced server (mean over rounds; [min..max] of per-round values)")
    hdr = (
        f"{'scenario':<54} {'off req/s':>10} {'on req/s':>10} {'on/off':>7} {'[min..max]':>15}"
        f" {'p50 off→on µs':>16} {'Δp50':>7} {'p99 off→on µs':>16} {'Δp99':>7} {'[min..max]':>17}"
        f" {'srv CPU µs/req':>15} {'CPU0/CPU1 busy off→on':>22}"
    )
    L.append(hdr)
    L.append("-" * len(hdr))
    for sc_d in res["scenarios"]:
        key = sc_d["key"]
        if sc_d["kind"] == "syscall":
            continue
        o = res["overhead"][key]
        rs = o["throughput_ratio_span"]
        ratio_span = f"[{rs[0]:.3f}..{rs[1]:.3f}]"
        p50 = f"{o['p50_off_us']:.0f}→{o['p50_on_us']:.0f}"
        p99 = f"{o['p99_off_us']:.0f}→{o['p99_on_us']:.0f}"
        srv = f"{o['server_cpu_us_per_req_off']:.1f}→{o['server_cpu_us_per_req_on']:.1f}"
        b0, b1 = o["cpu_busy_off"], o["cpu_busy_on"]
        busy = f"{b0['cpu0']:.0%}/{b0['cpu1']:.0%}→{b1['cpu0']:.0%}/{b1['cpu1']:.0%}"
        behind = " !" if o.get("phases_generator_behind") else ""
        label = sc_d["label"] + _rate_note(res, key) + behind + _noise_note(o)
        L.append(
            f"{label:<54} {o['rps_off']:>10,} {o['rps_on']:>10,} "
            f"{o['throughput_ratio']:>7.3f} {ratio_span:>15} {p50:>16} {_pct(o['delta_p50']):>7} "
            f"{p99:>16} {_pct(o['delta_p99']):>7} {_spanpct(o['delta_p99_span']):>17} {srv:>15} "
            f"{busy:>22}"
        )
    L.append("   latency: wrk rows from send (closed loop); open-loop rows from each due time")
    L.append(
        "   [k/n]: k of n rounds used (rounds with foreign tracing BPF programs or other "
        "processes' CPU left out); [n/n*]: every round was disturbed"
    )
    if any(o.get("phases_generator_behind") for o in res["overhead"].values()):
        L.append(
            "   ! in some phases the open-loop generator sent late (median lag > 1 ms) or not "
            "every request due in the window was answered inside it: the server (or CPU0) could "
            "not keep up, so its latency is a queue's and its req/s counts only in-window answers"
        )
    sy = res["overhead"]["syscalls"]
    L.append(
        "   unrelated process (ns per call: nothing attached, empty programs, tracejoin; "
        f"tracejoin − empty [min..max]){_noise_note(sy)}:"
    )
    for k, label in (
        ("read_devzero_ns", "read(/dev/zero, 1 B)  [sys_enter/exit_read probed]"),
        ("read_pipe_ns", "read(pipe, 1 B)       [sys_enter/exit_read probed]"),
        ("write_devnull_ns", "write(/dev/null, 1 B) [sys_enter/exit_write probed]"),
        ("getppid_ns", "getppid()             [not probed: control]"),
    ):
        v = sy[k]
        if "empty" in v:
            L.append(
                f"     {label:<52} {v['off']:>6.0f} {v['empty']:>6.0f} {v['on']:>6.0f}  "
                f"{v['over_empty_ns']:+.0f} ns "
                f"[{v['over_empty_span'][0]:+.0f}..{v['over_empty_span'][1]:+.0f}]"
            )
        else:
            L.append(
                f"     {label:<52} {v['off']:>6.0f} → {v['on']:>6.0f}  Δ {v['delta_ns']:+6.0f} "
                f"ns [{v['delta_span'][0]:+.0f}..{v['delta_span'][1]:+.0f}]"
            )
    L.append("")
    ag = res["agent"]
    dest = {
        "otlp": "OTLP/HTTP protobuf to a local sink that discards",
        "file": "OTLP-JSON file on tmpfs",
    }[cfg["destination"]]
    budget = cfg.get("cpu_budget")  # absent: results from before the budget could shed
    if budget is not None:
        dest += "; CPU budget " + ("off" if float(budget) == 0 else budget)
    L.append(f"2. Agent cost (tracejoin run; spans: {dest})")
    st = [a["startup_s"] for a in ag["runs"]]
    load = _mean([a["probe_load_s"] for a in ag["runs"]])
    L.append(
        f"   start-up to ready: {_mean(st):.2f} s [{min(st):.2f}..{max(st):.2f}] over "
        f"{len(st)} starts (probes: compile or cache, load, attach {load:.1f} s)"
        + (
            f"; HTTP/2 on at {_mean(h2):.2f} s (its programs verified after ready)"
            if (h2 := [a["http2_s"] for a in ag["runs"] if "http2_s" in a])
            else ""
        )
    )
    last = ag["runs"][-1].get("rss_at_stop_mb", {})
    compiles = [a for a in ag["runs"] if a.get("bpf_source") == "compiled"]
    if compiles:
        L.append(
            f"   compiles: {len(compiles)} of {len(ag['runs'])} starts, in child processes: "
            + "; ".join(
                f"{a['compile_s']:.1f} s, peaks {a['compile_peak_mb']:.0f} MB summed"
                for a in compiles
            )
            + " (separate processes, gone before ready); the other starts loaded the cache"
        )
    if sched := {a["scheduler"] for a in ag["runs"] if a.get("scheduler")}:
        L.append("   scheduler: " + " / ".join(sorted(sched)))  # absent before --cpu-slice-ms
    L.append(
        f"   peak RSS: {max(a['peak_rss_mb'] for a in ag['runs']):.0f} MB (VmHWM); at stop "
        f"{last.get('VmRSS', 0):.0f} MB = anon {last.get('RssAnon', 0):.0f} + file "
        f"{last.get('RssFile', 0):.0f} (mapped libraries; clang/LLVM's code is unmapped after "
        "start-up) + shmem "
        f"{last.get('RssShmem', 0):.0f} MB"
    )
    L.append(
        "   CPU per traced record (user+sys; user only): "
        + "; ".join(
            f"{k} {v['cpu']:.1f} ({v['user']:.1f}) µs" for k, v in ag["per_scenario"].items()
        )
        + f"; all {ag['cpu_us_per_record'] or 0:.1f} µs; per exported span "
        f"{ag.get('cpu_us_per_span') or 0:.1f} µs"
    )
    L.append(
        f"   records per request (kernel records_submitted / requests): {ag['records_per_request']}"
    )
    b = res["bpf"]
    if b.get("programs"):
        L.append(
            f"   BPF run time, tracejoin's programs (loss-curve run, {b['requests']:,} requests; "
            f"{b['ns_per_request']:,.0f} ns of BPF per request):"
        )
        L.append(f"     {'program':<44} {'hits':>10} {'ns/hit':>8} {'hits/req':>9} {'ns/req':>8}")
        for p in b["programs"]:
            L.append(
                f"     {p['name']:<44} {p['hits']:>10,} {p['ns_per_hit']:>8.0f} "
                f"{p['hits_per_request']:>9.2f} {p['ns_per_request']:>8.0f}"
            )
        sl = b.get("syscall_loop")
        if sl:
            L.append(
                f"   BPF per call of the unrelated syscall loop ({sl['calls_each']:,} calls each): "
                + ", ".join(f"{p['name']} {p['ns_per_hit']:.0f} ns" for p in sl["programs"])
            )
    if res.get("stages"):
        L.append("   user-space stages on a synthetic record (bench.stages):")
        L.extend("     " + line for line in stages_table(res["stages"]).splitlines())
    L.append("")
    L.append("3. Loss curve (one agent; the µs server; open loop, then wrk at saturation)")
    L.append(
        f"   {'offered':>10} {'achieved':>9} {'requests':>9} {'submitted':>10} {'delivered':>10} "
        f"{'ringbuf_full':>13} {'user drops':>11} {'lost %':>7} {'shed':>8} {'µs/rec':>7} "
        f"{'BPF ns/req':>10}"
    )
    for s in res["loss_curve"]:
        L.append(
            f"   {s['offered']!s:>10} {s['achieved_rps']:>9,} {s['requests']:>9,} "
            f"{s['records_submitted']:>10,} {s['records_received']:>10,} "
            f"{s['lost_kernel_ringbuf_full']:>13,} {s['lost_userspace']:>11,} "
            f"{s['lost_fraction']:>7.1%} {s.get('sampled_out_budget', 0):>8,} "
            f"{s['cpu_us_per_record'] or 0:>7.1f} "
            f"{s['bpf_ns_per_request']:>10,}"
        )
    L.append("")
    L.append("4. Export throughput (bench.export_throughput)")
    ex = res["export"]
    if "paths" in ex:
        from bench.export_throughput import format_table

        L.extend("   " + line for line in format_table(ex).splitlines())
    else:
        L.append(f"   {ex.get('skipped', 'not run')}")
    L.append("")
    L.append("5. GPU sampler cost (bench.gpu_check)")
    gpu = res["gpu"]
    if "skipped" in gpu:
        L.append(f"   skipped: {gpu['skipped']}")
    else:
        for c in gpu["calls"]:
            L.append(
                f"   {c['function']:<44} {c['calls']:>5} calls  mean {c['mean_us']:>8.1f} µs  "
                f"p99 {c['p99_us']:>8.1f} µs"
            )
    L.append("")
    L.append("Targets")
    for t in judged(res):
        L.append(f"   {t['verdict']:<5} {t['name']:<52} {t['want']:<10} measured {t['measured']}")
    return "\n".join(L)


def judged(res: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets by today's rules, from the figures the result holds; a result too old for
    them keeps the verdicts it was written with. (2026-12-02: the loss target had read PASS
    for runs whose open-loop steps stopped below 20k req/s; judged again, those are n/a.)"""
    try:
        return [asdict(t) | {"verdict": t.verdict} for t in targets(res)]
    except (KeyError, TypeError):
        return list(res["targets"])


def _noise_note(o: dict) -> str:
    n = o.get("noise")
    if not n or (n["rounds_used"] == n["rounds"] and not n["all_disturbed"]):
        return ""
    return f" [{n['rounds_used']}/{n['rounds']}{'*' if n['all_disturbed'] else ''}]"


def _rate_note(res: dict, key: str) -> str:
    r = res["rates"].get(key)
    return f" ({r:,.0f}/s)" if r and key.endswith("half") else ""


# ------------------------------------------------------------------------------ sections


def stages_table(st: dict[str, Any]) -> str:
    from bench.stages import format_table

    return format_table(st)


def export_section(cfg: Config) -> dict[str, Any]:
    from bench.export_throughput import run as export_run

    return export_run(cfg.export_spans, cfg.export_repeat)


def gpu_section(quick: bool) -> dict[str, Any]:
    try:
        from tracejoin.core.metrics import Metrics
        from tracejoin.enrich.gpu_sampler import GpuSampler, probe_nvml

        from bench.gpu_check import measure_nvml_call_costs, measure_sample_cost
    except ImportError as exc:
        return {"skipped": f"cannot import the GPU sampler: {exc}"}
    status = probe_nvml()
    if not status.available:
        return {"skipped": f"NVML unavailable: {status.reason}"}
    costs = measure_nvml_call_costs(repeats=50 if quick else 200)
    sampler = GpuSampler(Metrics(), pcie_interval_s=3600)
    sampler.open()
    try:
        sampler.sample_once()  # PCIe is read once here; the timed ticks below do not read it
        tick = measure_sample_cost(sampler, 20 if quick else 50)
    finally:
        sampler.shutdown()
    return {"calls": [asdict(c) for c in [*costs, tick]]}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "kernel": platform.release(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "mem_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "cpu_model": "?",
        "hypervisor": "bare metal",
    }
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            k, _, v = line.partition(":")
            if k.strip() == "Model name":
                info["cpu_model"] = v.strip()
            elif k.strip() == "Hypervisor vendor":
                info["hypervisor"] = v.strip()
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        info["wrk"] = subprocess.run(
            ["wrk", "--version"], capture_output=True, text=True
        ).stdout.splitlines()[0]
    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        info["go"] = subprocess.run(
            ["go", "version"], capture_output=True, text=True, check=True
        ).stdout.strip()
    return info


def preflight() -> str | None:
    if os.geteuid() != 0:
        return "must run as root (it loads BPF programs): sudo make bench"
    for tool in ("wrk", "bpftool", "taskset", "go"):
        if shutil.which(tool) is None:
            return f"{tool} not found (make setup installs wrk and bpftool; Go must be on PATH)"
    return None


@contextlib.contextmanager
def restore_on_signal(switch: m.BpfStatsSwitch) -> Iterator[None]:
    """Ctrl-C or SIGTERM still put kernel.bpf_stats_enabled back."""

    def handler(signum: int, _frame: object) -> None:
        switch.restore()
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        switch.restore()
        signal.signal(signal.SIGTERM, old)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="~2 minutes: shorter, fewer phases")
    ap.add_argument("--rounds", type=int, help="off/on rounds (at least 3 for the report)")
    ap.add_argument("--phase-seconds", type=int, help="seconds per load phase")
    ap.add_argument(
        "--destination",
        choices=["otlp", "file"],
        help="where the agent exports: otlp (default; OTLP/HTTP protobuf to a local sink that "
        "discards) or file (OTLP-JSON lines on tmpfs)",
    )
    ap.add_argument(
        "--cpu-budget",
        type=float,
        help="the agents' --cpu-budget (default 0: off, every request traced, what the targets "
        "measure; 0.5: as deployed, the budget sheds above it)",
    )
    ap.add_argument(
        "--loss-only",
        action="store_true",
        help="calibrate, run the loss curve alone (one fresh agent) and print its steps with "
        "the agent's CPU per record; no JSON",
    )
    ap.add_argument(
        "--loss-rates",
        type=lambda v: tuple(int(x) for x in v.split(",")),
        help="the loss curve's open-loop rates, comma-separated (e.g. 20000)",
    )
    ap.add_argument("--loss-seconds", type=int, help="seconds per loss-curve step")
    ap.add_argument("--json", type=Path, help="write the JSON here instead of bench/results/")
    ap.add_argument(
        "--report", type=Path, help="print the table of a saved JSON result; run nothing"
    )
    args = ap.parse_args(argv)
    if args.report:
        print(format_report(json.loads(args.report.read_text())))
        return 0
    problem = preflight()
    if problem:
        print(f"bench: {problem}", file=sys.stderr)
        return 2
    cfg = QUICK if args.quick else Config()
    if args.rounds:
        cfg = Config(**{**asdict(cfg), "rounds": args.rounds})
    if args.phase_seconds:
        cfg = Config(**{**asdict(cfg), "phase_s": args.phase_seconds})
    if args.destination:
        cfg = Config(**{**asdict(cfg), "destination": args.destination})
    if args.cpu_budget is not None:
        cfg = Config(**{**asdict(cfg), "cpu_budget": f"{args.cpu_budget:g}"})
    if args.loss_rates:
        cfg = Config(**{**asdict(cfg), "loss_rates": args.loss_rates})
    if args.loss_seconds:
        cfg = Config(**{**asdict(cfg), "loss_s": args.loss_seconds})
    if (os.cpu_count() or 1) < 2:
        cfg = Config(**{**asdict(cfg), "server_cpu": None, "load_cpu": None, "agent_cpu": None})
    elif cfg.load_cpu is not None:
        os.sched_setaffinity(0, {cfg.load_cpu})  # this process too: keep the server's CPU quiet

    started = dt.datetime.now().astimezone()
    t0 = time.monotonic()

    def log(s: str) -> None:
        print(f"[{time.monotonic() - t0:6.1f}s] {s}", flush=True)

    log("building the test server and the load generator")
    m.go_server_binary()
    m.loadgen_binary()
    bench = Bench(cfg, log)
    loadavg = os.getloadavg()
    with contextlib.ExitStack() as stack:
        stack.enter_context(restore_on_signal(bench.stats_switch))
        stack.callback(shutil.rmtree, bench.bpf_cache, ignore_errors=True)
        srv = stack.enter_context(m.go_server(bench.port, cfg.server_cpu))
        if cfg.destination == "otlp":
            bench.sink_port = stack.enter_context(m.otlp_sink(cfg.load_cpu))
        bench.server_pid = srv.pid
        log(f"server on :{bench.port} (pid {srv.pid}); calibrating with the agent off")
        bench.calibrate()
        if args.loss_only:
            log("loss curve alone (agent on, kernel.bpf_stats_enabled=1)")
            bench.loss_curve()
            for s in bench.loss:
                print(f"{loss_line(s)}  agent {s['cpu_us_per_record'] or 0:.1f} µs/record")
            return 0
        for rnd in range(1, cfg.rounds + 1):
            log(f"round {rnd}/{cfg.rounds}: agent off")
            bench.phase(rnd, None, scenarios(cfg))
            log(f"round {rnd}/{cfg.rounds}: agent on")
            agent = bench.start_agent()
            try:
                bench.phase(rnd, agent, scenarios(cfg))
                if kernel_scenarios(cfg):
                    log(f"round {rnd}/{cfg.rounds}: probes attached, agent stopped")
                    os.kill(agent.pid, signal.SIGSTOP)
                    try:
                        bench.phase(rnd, None, kernel_scenarios(cfg), probes_only=agent)
                    finally:
                        os.kill(agent.pid, signal.SIGCONT)
                if shared_scenarios(cfg):
                    log(f"round {rnd}/{cfg.rounds}: agent on, moved to the server's CPU")
                    m.repin(agent.pid, cfg.server_cpu)
                    bench.phase(rnd, agent, shared_scenarios(cfg))
            finally:
                bench.stop_agent(agent)
        log("loss curve (agent on, kernel.bpf_stats_enabled=1)")
        bench.loss_curve()
    log("user-space stages, export throughput")
    from bench.stages import run as stages_run

    stages = stages_run(5_000 if args.quick else 20_000)
    export = export_section(cfg)
    log("GPU sampler")
    gpu = gpu_section(args.quick)

    res = assemble(bench, cfg, started, loadavg, export, gpu, args.quick)
    res["stages"] = stages
    res["wall_s"] = round(time.monotonic() - t0, 1)
    res["targets"] = judged(res)
    print()
    print(format_report(res))
    out = args.json or RESULTS / f"{started.strftime('%Y%m%dT%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    print(f"\nJSON: {out}")
    return 0


def assemble(
    bench: Bench,
    cfg: Config,
    started: dt.datetime,
    loadavg: tuple[float, float, float],
    export: dict[str, Any],
    gpu: dict[str, Any],
    quick: bool,
) -> dict[str, Any]:
    scs = all_scenarios(cfg)
    ov = {sc.key: overhead(bench.phases, sc) for sc in scs}
    for s in bench.loss:
        s["lost_userspace"] = s["lost_userspace_records"] + s["spans_dropped_export"]
        lost = s["lost_kernel_ringbuf_full"] + s["lost_userspace_records"]
        s["lost_fraction"] = round(lost / max(1, s["records_submitted"]), 4)
    per_scenario = {}
    for sc in scs:
        if sc.kind == "syscall":
            continue
        ags = [
            p["agent_cost"] for p in bench.phases if "agent_cost" in p and p["scenario"] == sc.key
        ]
        rec = sum(a["records_received"] for a in ags)
        if rec:
            per_scenario[sc.key] = {
                "cpu": sum(map(_cpu_s, ags)) * 1e6 / rec,
                "user": sum(a["cpu_user_s"] for a in ags) * 1e6 / rec,
            }
    http_on = [p for p in bench.phases if "agent_cost" in p and p["scenario"] != "syscalls"]
    on_agents = [p["agent_cost"] for p in http_on]
    foreign = [p["foreign_bpf_progs"] for p in bench.phases]
    return {
        "benchmark": "tracejoin",
        "mode": "quick" if quick else "full",
        "started": started.isoformat(timespec="seconds"),
        "config": asdict(cfg),
        "machine": machine(),
        "noise": {
            "loadavg_start": [round(x, 2) for x in loadavg],
            "phases": len(foreign),
            "phases_with_foreign_progs": sum(1 for f in foreign if f),
            "phases_disturbed": sum(1 for p in bench.phases if _disturbed(p)),
            "max_foreign_progs": max(foreign, default=0),
        },
        "rates": bench.rates,
        "scenarios": [asdict(s) for s in scs],
        "phases": bench.phases,
        "overhead": ov,
        "agent": {
            "runs": bench.agents,
            "cpu_us_per_record": _per_record(on_agents),
            "cpu_us_per_span": _per_span(on_agents),
            "per_scenario": {
                k: {"cpu": round(v["cpu"], 2), "user": round(v["user"], 2)}
                for k, v in per_scenario.items()
            },
            "records_per_request": round(
                sum(p["agent_cost"]["records_submitted"] for p in http_on)
                / max(1, sum(p["load"]["requests_total"] for p in http_on)),
                3,
            ),
        },
        "bpf": bench.bpf,
        "loss_curve": bench.loss,
        "export": export,
        "gpu": gpu,
    }


if __name__ == "__main__":
    sys.exit(main())
