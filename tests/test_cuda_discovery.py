"""CUDA (issue 14) without the kernel: the probed-call table, library discovery on a fake /proc,
and the span attributes built from a record's CUDA sums."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
from tracejoin.core import record
from tracejoin.core.model import Span
from tracejoin.enrich.enricher import EnrichedRecord
from tracejoin.kernel.cuda import CudaApi, Discovery, library_kind, load_apis
from tracejoin.kernel.probes import bpf_source_dir
from tracejoin.pipeline.spans import SHARED, SpanOptions, build_spans

APIS = load_apis(bpf_source_dir() / "cuda.h")


def test_table_rows_are_numbered_in_order_and_name_real_calls():
    assert [a.api for a in APIS] == list(range(len(APIS)))
    assert len({a.symbol for a in APIS}) == len(APIS)
    assert {a.cls for a in APIS} == {
        "CC_COPY_KIND",
        "CC_COPY",
        "CC_SYNC",
        "CC_GRAPH",
        "CC_LAUNCH",
        "CC_ALLOC",
        "CC_FREE",
    }
    names = {a.symbol for a in APIS}
    # the defaults of the issue, per-thread-stream variants included
    assert {"cudaMemcpy", "cudaMemcpyAsync_ptsz", "cuMemcpyHtoD_v2", "cudaMemcpy_ptds"} <= names
    assert {"cudaStreamSynchronize_ptsz", "cuCtxSynchronize", "cudaGraphLaunch"} <= names
    assert {"cudaMalloc", "cudaFree", "cuMemAlloc_v2"} <= names
    assert {a.symbol for a in APIS if a.cls == "CC_LAUNCH"} >= {
        "cudaLaunchKernel",
        "cuLaunchKernelEx",
    }
    assert all(re.fullmatch(r"cu(da)?[A-Z]\w+", a.symbol) for a in APIS)


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/usr/local/cuda/lib64/libcudart.so.12.4.127", "runtime"),
        ("/venv/lib/python3.11/site-packages/torch/lib/libcudart-9f1c2e3a.so.12", "runtime"),
        ("/venv/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12", "runtime"),
        ("/venv/site-packages/nvidia/cu13/lib/libcudart.so.13", "runtime"),
        ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", "driver"),
        ("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15", "driver"),
        ("/usr/lib/x86_64-linux-gnu/libcudnn.so.9", None),
        ("/usr/lib/libcudart_static.a", None),
        ("/opt/libcudart-evil.so.12", None),  # not a hash
    ],
)
def test_library_kind_by_file_name(path, kind):
    assert library_kind(path) == kind


def fake_proc(tmp: Path, pid: int, maps: list[str], exe: Path | None = None) -> Path:
    """/proc/<pid>/{maps,root,exe} as the kernel shows them; root is / (no container)."""
    proc = tmp / "proc"
    d = proc / str(pid)
    d.mkdir(parents=True)
    lines = [
        f"7f00000{i:05x}-7f00001{i:05x} r-xp 00000000 08:01 {i} {p}" for i, p in enumerate(maps)
    ]
    (d / "maps").write_text("\n".join(lines) + "\n")
    (d / "root").symlink_to("/")
    if exe is not None:
        (d / "exe").symlink_to(exe)
    return proc


def lib(tmp: Path, name: str) -> Path:
    p = tmp / "lib" / name
    p.parent.mkdir(exist_ok=True)
    p.write_bytes(name.encode())
    return p


def symbols_by_name(table: dict[str, set[str]]):
    return lambda path: table[os.path.basename(path)]


def test_hashed_runtime_and_driver_found_through_the_process_root(tmp_path):
    rt = lib(tmp_path, "libcudart-4f2a9c1b.so.12")
    drv = lib(tmp_path, "libcuda.so.1")
    other = lib(tmp_path, "libc.so.6")
    proc = fake_proc(tmp_path, 42, [str(rt), str(drv), str(other), str(rt)])
    syms = {rt.name: {"cudaMemcpy", "cudaFree", "notprobed"}, drv.name: {"cuMemcpyHtoD_v2"}}
    d = Discovery(APIS, proc, symbols_by_name(syms))
    new = d.scan([42])
    assert [(f.kind, f.path) for f in new] == [("runtime", str(rt)), ("driver", str(drv))]
    assert new[0].open_path == f"{proc}/42/root{rt}"
    assert new[0].symbols == ("cudaMemcpy", "cudaFree")
    assert d.scan([42]) == []  # each file once
    assert new[0].pids == {42}


def test_static_runtime_found_through_the_executable_symbol_table(tmp_path):
    drv = lib(tmp_path, "libcuda.so.1")
    exe = lib(tmp_path, "server")
    proc = fake_proc(tmp_path, 7, [str(exe), str(drv)], exe=exe)
    syms = {drv.name: {"cuMemcpyHtoD_v2"}, exe.name: {"cudaMemcpy", "main"}}
    (drv_f, exe_f) = Discovery(APIS, proc, symbols_by_name(syms)).scan([7])
    assert drv_f.kind == "driver"
    assert (exe_f.kind, exe_f.path, exe_f.symbols) == ("static", str(exe), ("cudaMemcpy",))


def test_stripped_static_runtime_is_reported_not_probeable(tmp_path):
    drv = lib(tmp_path, "libcuda.so.1")
    exe = lib(tmp_path, "stripped")
    proc = fake_proc(tmp_path, 9, [str(exe), str(drv)], exe=exe)
    d = Discovery(APIS, proc, symbols_by_name({drv.name: {"cuCtxSynchronize"}, exe.name: set()}))
    (only,) = d.scan([9])
    assert only.kind == "driver"
    assert "only its driver calls are probed" in d.notes[9]


def test_library_without_probed_calls_or_unreadable_is_not_probeable(tmp_path):
    rt = lib(tmp_path, "libcudart.so.12")
    proc = fake_proc(tmp_path, 3, [str(rt)])

    def broken(path: str) -> set[str]:
        raise OSError("not an ELF file")

    (f,) = Discovery(APIS, proc, broken).scan([3])
    assert f.state.startswith("not probeable: symbols unreadable")
    (g,) = Discovery(APIS, proc, lambda p: {"main"}).scan([3])
    assert g.state == "not probeable: defines none of the probed calls"


def test_gone_process_and_gone_file_are_skipped(tmp_path):
    proc = fake_proc(tmp_path, 5, [str(tmp_path / "lib" / "libcudart.so.12")])
    assert Discovery(APIS, proc, lambda p: set()).scan([5, 6]) == []


# ------------------------------------------------------------------------------ span attributes


def enriched(rec: record.HttpRecord) -> EnrichedRecord:
    return EnrichedRecord(
        rec, trace_id=1, parent_id=2, trace_flags=1, clock_offset_ns=0, resource={}
    )


def spans_for(rec: record.HttpRecord, signals=("workset", "cuda")) -> list[Span]:
    ids = iter(range(1, 100))
    return build_spans(enriched(rec), SpanOptions(frozenset(signals)), lambda bits: next(ids))


def cuda_record(shared: bool = False) -> record.HttpRecord:
    rec = record.HttpRecord()
    rec.type, rec.read_ns, rec.end_ns = record.REC_HTTP, 1_000_000, 90_000_000
    rec.ws_flags = record.WSF_TRACKED | record.WSF_CUDA
    rec.ws_threads = 1
    sums = rec.cuda.shared if shared else rec.cuda.own
    sums[record.CSIG_MEMCPY_H2D] = 4096
    sums[record.CSIG_MEMCPY_CALLS] = 1
    sums[record.CSIG_SYNC_NS] = 30_000_000
    sums[record.CSIG_SYNC_CALLS] = 1
    w = rec.cuda.waits[2]
    w.start_ns, w.dur_ns, w.tid, w.shared = 2_000_000, 30_000_000, 77, int(shared)
    w.api = next(a.api for a in APIS if a.symbol == "cudaStreamSynchronize")
    return rec


def test_own_calls_are_the_request_s_and_a_long_sync_is_a_child_span():
    server, *kids = spans_for(cuda_record())
    a = server.attributes
    assert a["tracejoin.cuda.memcpy.bytes.host_to_device"] == 4096
    assert a["tracejoin.cuda.sync.wait_ns"] == 30_000_000
    assert not [k for k in a if k.startswith(SHARED + "cuda")]
    (sync,) = kids
    assert sync.name == "cudaStreamSynchronize"
    assert sync.end_ns - sync.start_ns == 30_000_000
    assert sync.attributes["thread.id"] == 77
    assert "tracejoin.work.shared" not in sync.attributes


def test_calls_of_a_thread_serving_several_requests_are_only_shared():
    server, sync = spans_for(cuda_record(shared=True))
    a = server.attributes
    assert a["tracejoin.cuda.memcpy.bytes.host_to_device"] == 0  # never the request's own
    assert a[SHARED + "cuda.memcpy.bytes.host_to_device"] == 4096
    assert a[SHARED + "cuda.sync.wait_ns"] == 30_000_000
    assert sync.attributes["tracejoin.work.shared"] is True


def test_no_cuda_attributes_without_the_signal_or_without_calls():
    for signals in (("workset",), ("cuda",)):  # cuda off; or the work set not followed
        (server, *_) = spans_for(cuda_record(), signals)
        assert not [k for k in server.attributes if "cuda" in k]
    rec = cuda_record()
    rec.ws_flags &= ~record.WSF_CUDA  # no probed call: no block in the record
    (server,) = spans_for(rec)
    assert not [k for k in server.attributes if "cuda" in k]


def test_launches_only_when_asked_for():
    (server, _) = spans_for(cuda_record())
    assert "tracejoin.cuda.launches" not in server.attributes
    (server, _) = spans_for(cuda_record(), ("workset", "cuda", "cuda_launches"))
    assert server.attributes["tracejoin.cuda.launches"] == 0


def test_return_probes_only_where_a_return_is_needed():
    """Runtime calls (their return ends the nesting window) and synchronisations (the wait) have
    one; a driver copy, allocation, free or launch is counted at its entry."""
    for a in APIS:
        assert a.ret == (a.layer == "runtime" or a.cls == "CC_SYNC"), a


def test_api_row_type():
    assert CudaApi(0, "cudaMemcpy", "CC_COPY_KIND").layer == "runtime"
    assert CudaApi(8, "cuMemcpyHtoD_v2", "CC_COPY").entry_fn == "cuda_e_8"


# ------------------------------------------------------------------------------ capture summary


def test_summary_cuda_table_only_when_a_request_made_calls():
    from tracejoin.commands.summary import Summary

    cuda = {
        "tracejoin.work.shared_with_max": 0,
        "tracejoin.cuda.memcpy.bytes.host_to_device": 4 << 20,
        "tracejoin.cuda.memcpy.bytes.device_to_host": 4096,
        "tracejoin.cuda.memcpy.count": 2,
        "tracejoin.cuda.sync.wait_ns": 31_500_000,
        "tracejoin.cuda.alloc.bytes": 0,
    }
    batched = {"tracejoin.work.shared_with_max": 3, "tracejoin.work.shared.cuda.sync.wait_ns": 8e6}
    s = Summary()
    s.add("GET /plain", "a" * 32, 1_000_000, False, 200, {"tracejoin.work.shared_with_max": 0})
    assert "\ncuda " not in s.format()
    s.add("POST /infer", "b" * 32, 40_000_000, False, 200, cuda)
    s.add("POST /batch", "c" * 32, 40_000_000, False, 200, batched)
    text = s.format()
    table = text[text.index("\ncuda ") + 1 :].splitlines()
    assert table[0].split() == [
        *("cuda", "h2d", "B", "d2h", "B", "copies", "sync", "ms", "~sync", "ms"),
        *("graphs", "alloc", "B"),
    ]
    rows = {line.split()[1]: line.split()[2:] for line in table[3:6] if line.startswith("POST")}
    assert rows["/infer"][:4] == ["4.2M/4.2M", "4.1k/4.1k", "2/2", "31.5/31.5"]
    assert rows["/batch"][3:5] == ["0/0", "~8/~8"]  # shared: marked, not the request's own
    assert all(len(line) <= 100 for line in text.splitlines())


# ------------------------------------------------------------------------------ doctor


def test_doctor_lists_found_and_not_probeable_files(tmp_path):
    """Real ELF files (the test doubles), read by the real symbol reader, through a fake /proc."""
    import cuda_stubs
    from tracejoin.host.doctor import Status, check_cuda

    if cuda_stubs.compiler() is None:
        pytest.skip("no C compiler (gcc) to build the CUDA test doubles")
    stubs = cuda_stubs.build(tmp_path / "stubs")
    fake_proc(tmp_path, 11, [str(stubs.hashed), str(stubs.driver)])
    fake_proc(tmp_path, 12, [str(stubs.static_server), str(stubs.driver)], exe=stubs.static_server)
    stripped = tmp_path / "stripped-server"
    stripped.write_bytes(stubs.static_server.read_bytes())
    subprocess.run(["strip", str(stripped)], check=True)
    fake_proc(tmp_path, 13, [str(stripped), str(stubs.driver)], exe=stripped)
    check = check_cuda(tmp_path)
    assert check.status is Status.AVAILABLE, check
    assert check.detail == "3 of 3 CUDA files probeable with --cuda"
    files = {Path(f["path"]).name: f for f in check.data["files"]}
    assert files[stubs.hashed.name]["kind"] == "runtime"
    assert "cudaMemcpy" in files[stubs.hashed.name]["calls"]
    assert files["cuda-static-server"]["kind"] == "static"
    assert set(files["libcuda.so.1"]["calls"]) >= {"cuMemcpyHtoD_v2", "cuStreamSynchronize"}
    assert "only its driver calls are probed" in check.data["not_probeable"]["13"]
    assert any(n.startswith("pid 13: ") for n in check.notes)


def test_doctor_without_cuda_says_none_is_mapped(tmp_path):
    from tracejoin.host.doctor import Status, check_cuda

    check = check_cuda(tmp_path)
    assert check.status is Status.UNAVAILABLE
    assert check.detail.startswith("no process maps libcudart or libcuda now")


def test_a_failing_rescan_never_costs_a_record():
    from tracejoin.core.metrics import Metrics
    from tracejoin.kernel.probes import HttpProbes, ProbeConfig

    class Ring:
        def __init__(self, probes: HttpProbes) -> None:
            self.probes = probes

        def ring_buffer_consume(self) -> None:
            self.probes._batch.append(bytes(record.HttpRecord()))

    class Broken:
        def track(self, pids: object) -> None:
            pass

        def poll(self) -> None:
            raise OSError("proc went away mid-scan")

    metrics = Metrics()
    probes = HttpProbes(ProbeConfig(cuda=True), metrics)
    probes._bpf = Ring(probes)
    probes.cuda = Broken()  # type: ignore[assignment]
    assert len(probes.poll(timeout_ms=0)) == 1
    assert metrics.get("cuda_rescan_errors") == 1


def test_cuda_is_off_without_the_work_set_and_says_why():
    from conftest import privileged_missing
    from tracejoin.core.metrics import Metrics
    from tracejoin.kernel.probes import HttpProbes, ProbeConfig

    if reason := privileged_missing():
        pytest.skip(reason)
    probes = HttpProbes(ProbeConfig(cuda=True, workset=False), Metrics())
    knobs = probes.plan()
    assert "WITH_CUDA" not in knobs
    assert probes.status.signals["cuda"] == "off: needs the work set"
    on = HttpProbes(ProbeConfig(cuda=True, cuda_sync_threshold_ns=7_000_000), Metrics())
    knobs = on.plan()
    assert knobs["CUDA_SYNC_THRESHOLD_NS"] == 7_000_000 and "WITH_CUDA" in knobs
    assert "cuda_launches" not in on.status.signals
