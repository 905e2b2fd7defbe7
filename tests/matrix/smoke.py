"""The kernel-matrix smoke suite, run as root inside a guest by tests/matrix/guest-init.

Prints one JSON line (stdout is the guest's second serial port): what doctor says, which BPF
features the kernel has (and a real BCC load that proves the doctor right), and, where doctor
says the core can run, a `tracejoin capture` against real servers and a real client:

  trace id + parent   the span carries the caller's trace id and its parent span id
  recv-queue wait     a late reader (slowread server, SLEEP_MS) shows the wait it caused
  page faults         a handler that touches fresh pages shows at least that many minor faults
  tlb by mode         the TLB attributes match the tracejoin.tlb.mode the resource announces
  sigterm             SIGTERM ends the capture with its files written (stopped_by SIGTERM)
  no program left     bpftool lists as many programs after the capture as before it

On a kernel that doctor refuses, the agent must refuse too, naming the reason, with nothing
loaded. Steps are timed (BCC compiles slowly under TCG emulation: the table shows it).
"""

from __future__ import annotations

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parent.parent.parent
PYSERVER = SRC / "tests" / "servers" / "pyserver.py"
PY = sys.executable
TRACEJOIN = [PY, "-c", "from tracejoin.commands.cli import main; main()"]
SLEEP_MS = 200  # the late reader's delay: far above any emulation jitter
PAGES = 256
READY_TIMEOUT_S = 1200  # BCC compiling http.c under TCG


def log(msg: str) -> None:
    print(f"smoke: {msg}", file=sys.stderr, flush=True)


class Result:
    def __init__(self) -> None:
        self.data: dict[str, Any] = {"release": os.uname().release, "checks": [], "timings": {}}
        self._t = time.monotonic()

    def check(self, name: str, ok: bool | None, detail: str) -> None:
        log(f"{name}: {'ok' if ok else ('skip' if ok is None else 'FAIL')}: {detail}")
        self.data["checks"].append({"name": name, "ok": ok, "detail": detail})

    def timed(self, step: str) -> None:
        now = time.monotonic()
        self.data["timings"][step] = round(now - self._t, 1)
        self._t = now


def bpf_programs() -> list[dict[str, Any]]:
    out = subprocess.run(
        ["bpftool", "prog", "show", "--json"], capture_output=True, text=True, check=False
    )
    try:
        return list(json.loads(out.stdout or "[]"))
    except json.JSONDecodeError:
        return []


def programs_after(before: int, timeout_s: float = 15.0) -> int:
    """How many programs are loaded once the count is back to `before`, or after timeout_s.
    An exited agent's programs go in deferred kernel work (a prog array is cleared by a work
    item after its last fd closes, and only then are the programs in it freed), which a TCG
    guest can run seconds late; a program still there after that is left behind."""
    deadline = time.monotonic() + timeout_s
    while (n := len(bpf_programs())) != before and time.monotonic() < deadline:
        time.sleep(0.5)
    return n


def doctor(res: Result) -> dict[str, Any]:
    p = subprocess.run([*TRACEJOIN, "doctor", "--json"], capture_output=True, text=True)
    res.timed("doctor")
    try:
        doc = json.loads(p.stdout)
    except json.JSONDecodeError:
        out = (p.stdout[:200] + " | " + p.stderr[-200:]).replace("\n", " ")
        res.check("doctor", False, f"no JSON (rc {p.returncode}): {out}")
        return {}
    res.data["doctor"] = doc
    res.data["doctor_summary"] = doc["summary"]
    res.check("doctor", doc["exit_code"] == p.returncode, f"rc {p.returncode}: {doc['summary']}")
    return doc


# bpf_task_pt_regs (5.15): how a socket event reads its syscall's buffer from the thread's saved
# registers (bpf/http.c, syscall_args). Its real load through BCC is compared with doctor's
# helper probe.
TASK_PT_REGS_PROGRAM = r"""
TRACEPOINT_PROBE(syscalls, sys_enter_getppid) {
    u64 regs = (u64)bpf_task_pt_regs((struct task_struct *)bpf_get_current_task_btf());
    u64 v = 0;
    bpf_probe_read_kernel(&v, sizeof(v), (void *)regs);
    return v == 1;
}
"""


def features(res: Result, doc: dict[str, Any]) -> None:
    feats = {c["data"]["feature"]: c for c in doc.get("checks", []) if c["group"] == "BPF features"}
    res.data["features"] = {
        name: c["status"] + ("" if c["status"] == "available" else f": {c['detail'].split(';')[0]}")
        for name, c in feats.items()
    }
    from bcc import BPF
    from tracejoin.host.doctor import _bcc_errors, _Fd2Capture

    err = None
    with _Fd2Capture() as stderr:  # libbcc says there what the kernel refused
        try:
            BPF(text=TASK_PT_REGS_PROGRAM.encode()).cleanup()
        except Exception as e:  # bcc raises bare Exception on a failed load
            err = str(e).splitlines()[0] if str(e) else type(e).__name__
    if err is not None:
        err = _bcc_errors(stderr.text()) or err
    res.timed("task pt_regs trial")
    loaded = err is None
    res.data["task_pt_regs_trial"] = "loaded" if loaded else f"failed: {err}"
    said = feats.get("task_pt_regs", {}).get("status")
    res.check(
        "task pt_regs probe agrees",
        said == ("available" if loaded else "unavailable"),
        f"doctor: {said}; a BCC program calling bpf_task_pt_regs: {res.data['task_pt_regs_trial']}",
    )


def new_traceparent() -> tuple[str, str, str]:
    trace, parent = f"{random.getrandbits(128) | 1:032x}", f"{random.getrandbits(64) | 1:016x}"
    return f"00-{trace}-{parent}-01", trace, parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(mode: str, port: int, **env: str) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(
        [PY, str(PYSERVER), mode, str(port)],
        stdout=subprocess.PIPE,
        env={**os.environ, **env},
    )
    assert p.stdout is not None
    if p.stdout.readline().strip() != b"ready":
        raise RuntimeError(f"{mode} server did not start")
    return p


def get(port: int, path: str, tp: str) -> int:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("GET", path, headers={"traceparent": tp})
    r = c.getresponse()
    r.read()
    c.close()
    return r.status


def spans_by_trace(path: Path) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """trace id -> (server span, resource attributes), from the OTLP-JSON lines file."""
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        for rs in json.loads(line).get("resourceSpans", []):
            rattrs = {a["key"]: a["value"] for a in rs.get("resource", {}).get("attributes", [])}
            for ss in rs.get("scopeSpans", []):
                for sp in ss.get("spans", []):
                    if sp.get("kind") in (2, "SPAN_KIND_SERVER"):  # not its child intervals
                        out[sp["traceId"].lower()] = (sp, rattrs)
    return out


def attr(span: dict[str, Any], key: str) -> Any:
    for a in span.get("attributes", []):
        if a["key"] == key:
            v = a["value"]
            return int(v["intValue"]) if "intValue" in v else next(iter(v.values()))
    return None


def capture(res: Result, supported: bool) -> None:
    before = len(bpf_programs())
    web, late = free_port(), free_port()
    servers = [
        start_server("threaded", web),
        start_server("slowread", late, SLEEP_MS=str(SLEEP_MS)),
    ]
    out = Path("/tmp/capture")
    cmd = [*TRACEJOIN, "capture", "--port", str(web), "--port", str(late), "--output-dir", str(out)]
    agent = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert agent.stdout is not None and agent.stderr is not None
    lines: list[bytes] = []
    ready = threading.Event()

    def pump() -> None:
        assert agent.stdout is not None
        for line in iter(agent.stdout.readline, b""):
            lines.append(line)
            if line.startswith(b"capturing"):
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        ready.wait(READY_TIMEOUT_S)
        res.timed("agent start (compile, load, attach)")
        if agent.poll() is not None or not any(ln.startswith(b"capturing") for ln in lines):
            agent.wait(60)
            err = agent.stderr.read().decode(errors="replace")
            reason = next(
                (ln for ln in err.splitlines() if "tracepoint" in ln or "rror" in ln), err[-300:]
            )
            res.data["loads"] = {"ok": False, "detail": reason.strip()}
            if supported:
                res.check("agent starts", False, f"rc {agent.returncode}: {reason.strip()}")
            else:
                named = "required tracepoint" in err
                res.check(
                    "agent refuses with the reason", named and agent.returncode != 0, reason.strip()
                )
            after = programs_after(before)
            res.check("no program left", after == before, f"{after} programs, {before} before")
            return
        progs = len(bpf_programs()) - before
        head = next(ln for ln in lines if ln.startswith(b"capturing")).decode()
        load_s = (
            float(head.split("probes ready in ")[1].split("s")[0])
            if "probes ready in " in head
            else 0.0
        )
        res.data["loads"] = {"ok": True, "programs": progs, "seconds": load_s}
        if not supported:
            res.check(
                "agent refuses with the reason", False, "it started on a kernel doctor refused"
            )
        tp_pages, tr_pages, par_pages = new_traceparent()
        tp_tlb, tr_tlb, _ = new_traceparent()
        tp_late, tr_late, _ = new_traceparent()
        statuses = [
            get(web, f"/pages?n={PAGES}", tp_pages),
            get(web, "/tlb?n=64", tp_tlb),
            get(late, "/late", tp_late),
        ]
        res.timed("traffic")
        spans_file = out / "spans.otlp.jsonl"
        deadline = time.monotonic() + 60
        want = {tr_pages, tr_tlb, tr_late}
        while time.monotonic() < deadline and not want <= set(spans_by_trace(spans_file)):
            time.sleep(0.5)
        agent.send_signal(signal.SIGTERM)
        rc = agent.wait(120)
        res.timed("spans + SIGTERM")
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        for s in servers:
            s.kill()
            s.wait()
    info = json.loads((out / "capture.json").read_text()) if (out / "capture.json").exists() else {}
    res.data["signals"] = dict(info.get("signals", {}))
    res.data["signals"]["tlb"] = info.get("tlb_mode", "?")
    res.check(
        "sigterm",
        rc == 0 and info.get("stopped_by") == "SIGTERM",
        f"rc {rc}, stopped_by {info.get('stopped_by')}, http {statuses}",
    )
    after = programs_after(before)
    res.check(
        "no program left",
        after == before,
        f"{after} programs after, {before} before, {progs} while running",
    )
    spans = spans_by_trace(out / "spans.otlp.jsonl")
    res.data["spans"] = len(spans)
    sp = spans.get(tr_pages, ({}, {}))[0]
    res.check(
        "trace id + parent",
        bool(sp) and sp.get("parentSpanId", "").lower() == par_pages,
        f"span {'found' if sp else 'missing'}, parent {sp.get('parentSpanId')} (sent {par_pages})",
    )
    faults = attr(sp, "tracejoin.mm.minor_faults") if sp else None
    res.check(
        "page faults",
        faults is not None and faults >= PAGES,
        f"{faults} minor faults for {PAGES} pages",
    )
    sp_late = spans.get(tr_late, ({}, {}))[0]
    wait = attr(sp_late, "tracejoin.tcp.receive_queue_wait_ns") if sp_late else None
    if res.data["signals"].get("recvq", "on") != "on":
        res.check(
            "recv-queue wait",
            wait is None,
            f"recvq {res.data['signals']['recvq']}; attribute {wait}",
        )
    else:
        ok = wait is not None and wait >= SLEEP_MS * 900_000
        res.check("recv-queue wait", ok, f"{wait} ns for a {SLEEP_MS} ms late read")
    sp_tlb, r_tlb = spans.get(tr_tlb, ({}, {}))
    mode = (r_tlb.get("tracejoin.tlb.mode") or {}).get("stringValue")
    flushes = attr(sp_tlb, "tracejoin.tlb.flushes") if sp_tlb else None
    dtlb = attr(sp_tlb, "tracejoin.tlb.dtlb_load_misses") if sp_tlb else None
    if mode == "hardware":
        ok, seen = dtlb is not None and flushes is None, f"dtlb_load_misses {dtlb}"
    elif mode == "flush_fallback":
        ok, seen = flushes is not None and flushes > 0 and dtlb is None, f"flushes {flushes}"
    else:
        ok, seen = (
            mode == "off" and flushes is None and dtlb is None,
            f"flushes {flushes}, dtlb {dtlb}",
        )
    res.check("tlb by mode", ok, f"tracejoin.tlb.mode {mode}: {seen}")


def doctor_signals(doc: dict[str, Any]) -> dict[str, str]:
    """Doctor's view of each signal, under the agent's names (replaced by the agent's own
    view when a capture runs)."""
    from tracejoin.host.doctor import TLB_SIGNAL
    from tracejoin.kernel.probes import OPTIONAL_SIGNALS

    names = {sig.what: sig.name for sig in OPTIONAL_SIGNALS}
    names[TLB_SIGNAL] = "tlb"
    names["software perf events (cpu-clock)"] = "page_faults"
    return {
        names[s["name"]]: f"doctor: {s['status']}"
        for s in doc.get("signals", [])
        if s["name"] in names
    }


def main() -> None:
    res = Result()
    try:
        doc = doctor(res)
        res.data["supported"] = bool(doc.get("ok"))
        res.data["signals"] = doctor_signals(doc)
        if doc:
            features(res, doc)
        capture(res, bool(doc.get("ok")))
    except Exception as e:  # the host must get a result, whatever broke
        res.data["error"] = f"smoke crashed: {type(e).__name__}: {e}"
    print(json.dumps(res.data), flush=True)


if __name__ == "__main__":
    main()
