"""The probes' compiled form (agent/kernel/compiled.py): compiled in child processes, kept in a
root-only cache, and loaded by later starts without compiling; what a cached start traces is
what a compiled one does."""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import time
from pathlib import Path

import pytest
from harness import Agent, free_ports, new_traceparent, raw_request, server
from tracejoin.core.metrics import Metrics
from tracejoin.kernel import compiled
from tracejoin.kernel.compiled import CompileError, Entry, FuncSpec, MapSpec
from tracejoin.kernel.cuda import load_apis
from tracejoin.kernel.probes import (
    HttpProbes,
    ProbeConfig,
    bpf_source_dir,
    compiled_apart,
    compiled_apart_after_ready,
    compiled_later,
)


def _insn(code: int, src: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhI", code, src << 4, 0, imm & 0xFFFFFFFF)


def _entry(key: str = "k") -> Entry:
    spec = MapSpec("counters", "counters", 6, 4, 8, 64, 0, '"int"', '"unsigned long long"')
    insns = _insn(0x18, 1, 7) + _insn(0) + _insn(0x95)
    return Entry(key, "GPL", 0, (spec,), {"f": FuncSpec(insns, ((0, 0),))})


def test_an_entry_reads_back_as_written():
    entry = _entry()
    assert Entry.from_bytes(entry.to_bytes()) == entry


def test_map_references_are_found_and_other_relocations_refused():
    """ld_imm64 naming a map by fd is replayed with the new map's fd; a subprogram reference
    needs nothing; anything else (a map value, a kernel symbol) cannot be replayed."""
    insns = _insn(0xB7) + _insn(0x18, 1, 9) + _insn(0) + _insn(0x18, 4, 3) + _insn(0)
    insns += _insn(0x18, 1, 12) + _insn(0) + _insn(0x95)
    assert compiled._map_refs("p", insns, {9: 0, 12: 1}) == ((1, 0), (5, 1))
    with pytest.raises(CompileError, match="fd 12, not a map"):
        compiled._map_refs("p", insns, {9: 0})
    with pytest.raises(CompileError, match="ld_imm64 kind 2"):
        compiled._map_refs("p", _insn(0x18, 2, 9) + _insn(0), {9: 0})


def test_a_bpf_loop_callback_is_linked_into_each_program_that_names_it():
    """LOOP_CB(fn) is an ld_imm64 of LOOP_CB_MARK << 32 | LOOP_CB_fn (#defined): the
    callback's instructions are appended to the program once, however often it is named, the
    ld_imm64 becomes a relative BPF_PSEUDO_FUNC reference to them, the callback's own map
    references move with it, and the program's func_info gets a record for it."""
    defined = dict(line.split()[1:] for line in compiled.loop_callback_defines(("cb",)))
    mark, cb_id = (int(defined[k].rstrip("UL"), 16) for k in ("LOOP_CB_MARK", "LOOP_CB_cb"))
    marker = _insn(0x18, 0, cb_id) + _insn(0, 0, mark)  # r0 = mark << 32 | id
    prog = _insn(0x18, 1, 5) + _insn(0) + marker + marker + _insn(0x95)  # map ref at 0
    cb = _insn(0xB7) + _insn(0x18, 1, 6) + _insn(0) + _insn(0x95)  # map ref at 1
    linked = compiled.link_callbacks(
        {"prog": FuncSpec(prog, ((0, 0),)), "cb": FuncSpec(cb, ((1, 1),))}
    )
    p = linked["prog"]
    assert p.insns[: 2 * 8] == prog[: 2 * 8] and p.insns[len(prog) :] == cb
    assert p.subprogs == ((7, "cb"),) and p.map_refs == ((0, 0), (8, 1))
    for at in (2, 4):  # both markers: src_reg BPF_PSEUDO_FUNC, imm = 7 - (at + 1), high half 0
        code, regs, _, imm = struct.unpack_from("<BBhi", p.insns, at * 8)
        assert (code, regs >> 4, imm) == (0x18, 4, 7 - at - 1)
        assert struct.unpack_from("<i", p.insns, (at + 1) * 8 + 4)[0] == 0
    assert linked["cb"] == FuncSpec(cb, ((1, 1),))  # named by no one: as compiled
    again = Entry("k", "GPL", 0, (), linked)
    assert Entry.from_bytes(again.to_bytes()) == again
    # a marker whose function is not in the module, a callback naming one: refused
    stray = _insn(0x18, 0, cb_id + 1) + _insn(0, 0, mark) + _insn(0x95)
    with pytest.raises(CompileError, match="no such function"):
        compiled.link_callbacks({"prog": FuncSpec(stray, ()), "cb": FuncSpec(cb, ())})
    nested = {"prog": FuncSpec(prog[16:], ()), "cb": FuncSpec(marker + _insn(0x95), ())}
    with pytest.raises(CompileError, match="names a callback itself"):
        compiled.link_callbacks(nested)


_UNITS_TEXT = """\
BPF_ARRAY(counters, u64, 4);
static __always_inline int helper(int x)
{
    return x + 1;
}
TRACEPOINT_PROBE(sched, sched_switch)
{
    return helper(1);
}
RAW_TRACEPOINT_PROBE(sched_waking) { return helper(2); }
int h2_scan(void *ctx)
{
    if (helper(3))
        return 0;
    return 1;
}
int h2_steps(struct loop_arg a) { return helper(4); }
PROGRAMS(ENTRY)
PROGRAMS(H2_ENTRY)
int made_elsewhere(void *ctx);
"""


def test_a_text_splits_into_the_programs_apart_and_the_rest():
    """Each unit keeps every declaration, helper and map, and only its own programs, whole,
    whether defined by a probe macro or as `int name(`, on one line or many, or made by an
    X-macro line (named by its text)."""
    rest, apart = compiled.unit_texts(
        _UNITS_TEXT, lambda name: name.startswith("h2_") or name == "PROGRAMS(H2_ENTRY)"
    )
    for unit in (rest, apart):
        assert "BPF_ARRAY(counters" in unit and "return x + 1;" in unit
    assert "PROGRAMS(ENTRY)" in rest and "PROGRAMS(H2_ENTRY)" not in rest
    assert "PROGRAMS(H2_ENTRY)" in apart and "PROGRAMS(ENTRY)" not in apart
    for unit in (rest, apart):  # a declaration is no definition: both keep it, and what follows
        assert unit.endswith("int made_elsewhere(void *ctx);\n")
    assert "sched_switch" in rest and "sched_waking" in rest and "return helper(1);" in rest
    assert "h2_" not in rest and "helper(3)" not in rest and "return 1;" not in rest
    assert "h2_scan" in apart and "return 1;" in apart and "h2_steps" in apart
    assert "sched_switch" not in apart and "helper(1)" not in apart and "helper(2)" not in apart
    assert rest.count("}") == apart.count("}") == 3  # the helper's and two programs', whole
    assert compiled.unit_texts(_UNITS_TEXT, lambda name: False) == [_UNITS_TEXT]
    switch = compiled.unit_texts(_UNITS_TEXT, lambda n: n == "tracepoint__sched__sched_switch")
    assert "sched_switch" not in switch[0] and "sched_waking" not in switch[1]


def test_a_second_compiler_that_cannot_start_leaves_no_first_one_running(tmp_path, monkeypatch):
    started = []
    real = compiled.subprocess.Popen

    def popen(*args, **kwargs):
        if started:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(compiled.subprocess, "Popen", popen)
    with pytest.raises(OSError):
        compiled._compile_in_children(["int a;", "int b;"], [], "k", tmp_path)
    assert started and started[0].returncode is not None  # killed and reaped


def test_units_merge_by_map_name_and_must_agree():
    """A unit's map references are renumbered to the merged map list by name; a program both
    units compiled is kept once; units that disagree on a map or a program are refused."""
    a = MapSpec("a", "a", 2, 4, 8, 1, 0, '"int"', '"u64"')
    b = MapSpec("b", "b", 2, 4, 8, 2, 0, '"int"', '"u64"')
    ref = _insn(0x18, 1, 7) + _insn(0) + _insn(0x95)
    one = Entry("k", "GPL", 0, (a, b), {"f": FuncSpec(ref, ((0, 1),)), "both": FuncSpec(ref, ())})
    two = Entry("k", "GPL", 0, (b, a), {"g": FuncSpec(ref, ((0, 1),)), "both": FuncSpec(ref, ())})
    merged = compiled.merge([one, two])
    assert merged.maps == (a, b)
    assert merged.funcs["f"].map_refs == ((0, 1),) and merged.funcs["g"].map_refs == ((0, 0),)
    assert set(merged.funcs) == {"f", "both", "g"}
    bigger = MapSpec("a", "a", 2, 4, 8, 99, 0, '"int"', '"u64"')
    with pytest.raises(CompileError, match="map a: the compile units made it differently"):
        compiled.merge([one, Entry("k", "GPL", 0, (bigger,), {})])
    other = Entry("k", "GPL", 0, (a, b), {"both": FuncSpec(_insn(0x95), ())})
    with pytest.raises(CompileError, match="both: the compile units compiled it differently"):
        compiled.merge([one, other])


def test_two_compilers_only_where_the_memory_cgroup_has_room_for_them(tmp_path, monkeypatch):
    """The least room (limit less usage) over this cgroup and those above it, v2 or v1's
    memory controller; no limit anywhere: None. Under TWO_COMPILERS_BYTES: one compiler."""
    mib = 2**20

    def group(path: str, files: dict[str, str]) -> None:
        d = tmp_path / path
        d.mkdir(parents=True, exist_ok=True)
        for name, value in files.items():
            (d / name).write_text(value + "\n")

    group("kubepods/pod1/ctr", {"memory.max": "max", "memory.current": str(100 * mib)})
    group("kubepods/pod1", {"memory.max": str(512 * mib), "memory.current": str(300 * mib)})
    group("kubepods", {"memory.max": "max", "memory.current": str(900 * mib)})
    assert compiled.memory_headroom("0::/kubepods/pod1/ctr\n", tmp_path) == 212 * mib
    assert compiled.memory_headroom("0::/kubepods\n", tmp_path) is None  # no limit
    unlimited = str(9223372036854771712)
    group("memory/api/x", {"memory.limit_in_bytes": unlimited, "memory.usage_in_bytes": "5"})
    v1 = "4:memory:/api/x\n0::/\n"  # a hybrid host: v1's memory controller decides
    assert compiled.memory_headroom(v1, tmp_path) is None
    group("memory/api", {"memory.limit_in_bytes": str(1024 * mib), "memory.usage_in_bytes": "0"})
    assert compiled.memory_headroom(v1, tmp_path) == 1024 * mib
    assert compiled.memory_headroom("", tmp_path) is None
    monkeypatch.setattr(compiled, "cpu_limit", lambda: None)
    monkeypatch.setattr(compiled, "memory_headroom", lambda: 212 * mib)
    assert not compiled._room_for_two()
    monkeypatch.setattr(compiled, "memory_headroom", lambda: None)
    assert compiled._room_for_two() == (len(os.sched_getaffinity(0)) >= 2)


def test_two_compilers_only_where_the_cpu_limit_has_room_for_them(tmp_path, monkeypatch):
    """A pod's CPU limit is a quota, not an affinity: the least quota / period over this cgroup
    and those above it (v2's cpu.max, or v1's cpu controller, mounted as cpu,cpuacct); no
    quota anywhere: None. Two compilers at once need it to round up to 2 or more."""

    def group(path: str, files: dict[str, str]) -> None:
        d = tmp_path / path
        d.mkdir(parents=True, exist_ok=True)
        for name, value in files.items():
            (d / name).write_text(value + "\n")

    group("kubepods/pod1/ctr", {"cpu.max": "max 100000"})
    group("kubepods/pod1", {"cpu.max": "150000 100000"})
    group("kubepods", {"cpu.max": "max 100000"})
    assert compiled.cpu_limit("0::/kubepods/pod1/ctr\n", tmp_path) == 1.5
    assert compiled.cpu_limit("0::/kubepods\n", tmp_path) is None  # no quota
    group("cpu,cpuacct/api/x", {"cpu.cfs_quota_us": "-1", "cpu.cfs_period_us": "100000"})
    v1 = "3:cpu,cpuacct:/api/x\n0::/\n"  # a hybrid host: v1's cpu controller decides
    assert compiled.cpu_limit(v1, tmp_path) is None
    group("cpu,cpuacct/api", {"cpu.cfs_quota_us": "50000", "cpu.cfs_period_us": "100000"})
    assert compiled.cpu_limit(v1, tmp_path) == 0.5
    assert compiled.cpu_limit("", tmp_path) is None
    monkeypatch.setattr(compiled, "memory_headroom", lambda: None)
    two_cpus = len(os.sched_getaffinity(0)) >= 2
    for limit, room in ((1.0, False), (1.2, two_cpus), (None, two_cpus)):
        monkeypatch.setattr(compiled, "cpu_limit", lambda limit=limit: limit)
        assert compiled._room_for_two() == room


@pytest.mark.privileged
def test_the_probes_compiled_as_two_units_are_the_probes_compiled_as_one(require_root, tmp_path):
    """The agent's own text, CUDA's X-macro programs included, compiled by two children,
    HTTP/2's programs and COMPILED_APART in the second, merges into exactly the entry one
    compile makes: the same programs, instructions, map references and maps. No program is
    compiled twice; each group of CUDA entries is in one unit."""
    probes = HttpProbes(ProbeConfig(cuda=True), Metrics())
    text, cflags = probes.render()
    assert "WITH_CUDA" in probes.plan()
    units = compiled.unit_texts(text, compiled_apart)
    assert len(units) == 2
    split, peak = compiled._compile_in_children(units, cflags, "k", tmp_path)
    assert not set(split[0].funcs) & set(split[1].funcs)
    second = {n for n in split[1].funcs if not n.startswith("cuda_e_")}
    assert second == {n for n in split[1].funcs if compiled_apart(n)}
    assert second >= {"h2_scan_rd", "h2_end", "ws_wake_prog"}
    assert not any(compiled_apart(n) for n in split[0].funcs)
    # the entry programs of calls with a return probe in the first, the others in the second
    returning = {f"cuda_e_{a.api}" for a in load_apis(bpf_source_dir() / "cuda.h") if a.ret}
    cuda_first = {n for n in split[0].funcs if n.startswith("cuda_e_")}
    cuda_second = {n for n in split[1].funcs if n.startswith("cuda_e_")}
    assert cuda_first == returning and cuda_second and not cuda_second & returning
    (one,), _ = compiled._compile_in_children([text], cflags, "k", tmp_path)
    assert compiled.merge(split) == compiled.merge([one])
    assert peak > 100 * 2**20  # two compilers' peaks


@pytest.mark.privileged
def test_programs_compiled_later_join_the_rest_and_only_the_whole_entry_is_kept(
    require_root, tmp_path
):
    """obtain(later=) returns once the rest are compiled (two children where there is room
    for two): no HTTP/2 program in its entry, and nothing in the cache yet. The deferred
    programs compile when result() asks, into exactly what one compile of the text makes; the
    BPF made from the rest takes them (load_func knows them only then), and the cache now holds
    the whole entry, which the next start loads with nothing left to compile."""
    text, cflags = HttpProbes(ProbeConfig(), Metrics()).render()
    cache = tmp_path / "bpf"
    got = compiled.obtain(
        text, cflags, cache, apart=compiled_apart_after_ready, later=compiled_later
    )
    assert got.source == "compiled" and got.later is not None
    assert got.units == (2 if compiled._room_for_two() else 1)
    assert "scan_req" in got.entry.funcs and "scan_resp" in got.entry.funcs
    assert not any(map(compiled_later, got.entry.funcs))
    assert not list(cache.glob("*.bpf.json"))
    bpf = compiled.cached_bpf(got.entry)
    try:
        with pytest.raises(Exception, match="Unknown program h2_scan_rd"):
            bpf.load_func(b"h2_scan_rd", 0)
        whole = got.later.result()
        bpf.extend(whole)
        assert bpf.load_func(b"h2_scan_rd", bpf.TRACEPOINT).fd >= 0
        assert bpf.load_func(b"scan_req", bpf.TRACEPOINT).fd >= 0
    finally:
        bpf.cleanup()
    (one,), _ = compiled._compile_in_children([text], cflags, "k", tmp_path)
    assert whole.funcs == compiled.merge([one]).funcs and whole.maps == got.entry.maps
    again = compiled.obtain(text, cflags, cache, apart=compiled_apart, later=compiled_later)
    assert (again.source, again.later, again.entry) == ("cache", None, whole)


@pytest.mark.privileged
def test_a_deferred_compile_starts_when_asked_and_an_agent_that_stops_leaves_none(
    require_root, tmp_path
):
    """Nothing compiles the deferred programs until result() asks (after ready: not beside the
    rest's compilers, nor beside the verifier after them). cancel() (the agent stopping) while
    they compile kills and reaps the compiler, result() says so and the cache keeps nothing;
    cancel() before then leaves nothing to start."""
    text, cflags = HttpProbes(ProbeConfig(), Metrics()).render()
    cache = tmp_path / "bpf"
    got = compiled.obtain(text, cflags, cache, later=compiled_later)
    deferred = got.later
    assert deferred is not None and deferred._child is None
    failed: list[BaseException] = []

    def wait() -> None:
        try:
            deferred.result()
        except CompileError as exc:
            failed.append(exc)

    waiter = threading.Thread(target=wait)
    waiter.start()
    deadline = time.monotonic() + 30
    while deferred._child is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert deferred._child is not None
    pid = deferred._child.proc.pid
    deferred.cancel()
    waiter.join(60)
    assert not Path(f"/proc/{pid}").exists()  # killed and reaped
    assert len(failed) == 1 and not list(cache.glob("*.bpf.json"))
    again = compiled.obtain(text, cflags, cache, later=compiled_later)
    assert again.later is not None
    again.later.cancel()
    with pytest.raises(CompileError, match="stopped before"):
        again.later.result()
    assert again.later._child is None


def test_the_key_covers_the_text_and_the_flags():
    base = compiled.cache_key("int x;", ["-DA"])
    assert base == compiled.cache_key("int x;", ["-DA"])
    assert base != compiled.cache_key("int y;", ["-DA"])
    assert base != compiled.cache_key("int x;", ["-DB"])


def test_an_entry_is_used_only_from_a_directory_and_file_no_one_else_can_write(tmp_path):
    """Its programs run in the kernel: a cache others can write is a way in."""
    entry = _entry()
    cache = tmp_path / "cache"
    assert compiled._private_dir(cache)
    assert cache.stat().st_mode & 0o777 == 0o700
    path = cache / "e.bpf.json"
    path.write_bytes(entry.to_bytes())
    path.chmod(0o600)
    assert compiled._read_entry(path, "k") == entry
    path.chmod(0o666)
    assert compiled._read_entry(path, "k") is None
    path.chmod(0o600)
    cache.chmod(0o777)
    assert not compiled._private_dir(cache)


def test_a_damaged_or_foreign_entry_is_not_used(tmp_path):
    path = tmp_path / "e.bpf.json"
    path.write_bytes(b'{"format": 1, "key": "k", "btf": "not base64')
    assert compiled._read_entry(path, "k") is None
    path.write_bytes(_entry("other").to_bytes())
    assert compiled._read_entry(path, "k") is None  # named for one text, made from another
    older = f'"format":{compiled.FORMAT - 1}'.encode()
    path.write_bytes(_entry().to_bytes().replace(f'"format":{compiled.FORMAT}'.encode(), older))
    assert compiled._read_entry(path, "k") is None  # an older tracejoin's
    path.write_bytes(b"[]")
    assert compiled._read_entry(path, "k") is None  # JSON, but not an entry


def test_the_cache_keeps_the_most_recently_used_entries(tmp_path):
    for i in range(5):
        p = tmp_path / f"{i}.bpf.json"
        p.write_bytes(b"{}")
        os.utime(p, (1000 + i, 1000 + i))
    compiled._prune(tmp_path, keep=3)
    assert sorted(p.name for p in tmp_path.glob("*.bpf.json")) == [
        "2.bpf.json",
        "3.bpf.json",
        "4.bpf.json",
    ]


@pytest.mark.privileged
def test_a_compile_error_carries_the_compilers_message(require_root):
    with pytest.raises(CompileError, match="error"):
        compiled.obtain("int broken( {", [], None)


def _traced(agent: Agent, port: int) -> tuple[int, int]:
    tp, trace_id, parent = new_traceparent()
    raw_request(
        port,
        f"GET /c HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\nConnection: close\r\n\r\n".encode(),
    )
    spans = agent.server_spans(trace_id)
    assert len(spans) == 1, f"no span for the request through port {port}"
    return spans[0].parent_span_id, parent


@pytest.mark.privileged
def test_a_start_from_the_cache_traces_as_the_compiling_start_did(require_root, tmp_path):
    """The first start compiles in a child and keeps the result; the second loads it without
    compiling. Both trace a real request into its caller's trace; the second never ran the
    compiler (no child's peak)."""
    cache = tmp_path / "bpf"
    (port,) = free_ports(1)
    seen = []
    with server("threaded", port):
        for _ in range(2):
            agent = Agent(
                [port], None, probe_config=ProbeConfig(ports=(port,), bpf_cache_dir=cache)
            )
            agent.start()
            try:
                status = agent.source.status
                got_parent, sent_parent = _traced(agent, port)
                bpf = agent.source._bpf
                assert bpf is not None
                agent_tgid = bpf[b"agent_tgid"][ctypes.c_int(0)].value
                seen.append((status.bpf_source, status.compile_peak_bytes))
            finally:
                agent.shutdown()
            assert got_parent == sent_parent
            assert agent_tgid == os.getpid()  # the work set leaves the agent's threads out
    (first_source, first_peak), (second_source, second_peak) = seen
    assert (first_source, second_source) == ("compiled", "cache")
    assert first_peak > 50 * 2**20 and second_peak == 0
    entries = list(cache.glob("*.bpf.json"))
    assert len(entries) == 1 and entries[0].stat().st_mode & 0o777 == 0o600


@pytest.mark.privileged
def test_a_damaged_cache_entry_is_compiled_again(require_root, tmp_path):
    cache = tmp_path / "bpf"
    (port,) = free_ports(1)
    with server("threaded", port):
        agent = Agent([port], None, probe_config=ProbeConfig(ports=(port,), bpf_cache_dir=cache))
        agent.start()
        agent.shutdown()
        (entry,) = cache.glob("*.bpf.json")
        entry.write_bytes(entry.read_bytes()[:1000])  # cut short: a crash mid-write elsewhere
        agent = Agent([port], None, probe_config=ProbeConfig(ports=(port,), bpf_cache_dir=cache))
        agent.start()
        try:
            assert agent.source.status.bpf_source == "compiled"
            got_parent, sent_parent = _traced(agent, port)
            assert got_parent == sent_parent
        finally:
            agent.shutdown()
    assert Entry.from_bytes(entry.read_bytes()).key == entry.name.split(".")[0]


@pytest.mark.privileged
def test_a_loaded_program_has_its_full_name_and_a_refused_one_says_why(require_root):
    """The kernel keeps 15 bytes of a program's name; the BTF made for the entry names it in
    full (what bpftool and the bench show). A program the verifier refuses fails with the
    verifier's own words, not only an errno."""
    import json
    import subprocess

    from bcc import BPF

    long_name = "tracepoint__syscalls__sys_enter_getppid"
    ok = FuncSpec(_insn(0xB7) + _insn(0x95), ())  # r0 = 0; exit
    refused = FuncSpec(_insn(0x95), ())  # exit with r0 never set
    bpf = compiled.cached_bpf(Entry("k", "GPL", 0, (), {long_name: ok, "tracepoint__bad": refused}))
    try:
        fd = bpf.load_func(long_name.encode(), BPF.TRACEPOINT).fd
        fdinfo = Path(f"/proc/self/fdinfo/{fd}").read_text()
        prog_id = next(ln.split()[1] for ln in fdinfo.splitlines() if ln.startswith("prog_id:"))
        shown = subprocess.run(
            ["bpftool", "-j", "prog", "show", "id", prog_id], capture_output=True, text=True
        )
        assert json.loads(shown.stdout)["name"] == long_name
        with pytest.raises(Exception, match="R0 !read_ok"):
            bpf.load_func(b"tracepoint__bad", BPF.TRACEPOINT)
    finally:
        bpf.cleanup()
