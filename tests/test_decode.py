"""The C <-> Python contract: the ctypes mirror and every constant in tracejoin.core.record match
bpf/http_record.h as the C compiler sees it, and the decoder counts bad input."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tracejoin.core import record
from tracejoin.core.metrics import Metrics
from tracejoin.core.record import WsMember
from tracejoin.kernel.decode import HTTP_METHOD_MAX, REC_HTTP, HttpRecord, RecordDecoder
from tracejoin.kernel.probes import bpf_source_dir

FIELDS = [name for name, _ in HttpRecord._fields_]
MEMBER_FIELDS = [name for name, _ in WsMember._fields_]
CUDA_FIELDS = [name for name, _ in record.CudaBlock._fields_]
WAIT_FIELDS = [name for name, _ in record.CudaWait._fields_]
# the budget's sampling entry and the kernel's aggregates of what it shed
SMALL_STRUCTS = {
    "sampling": record.Sampling,
    "policy": record.Policy,
    "agg_key": record.AggKey,
    "agg_val": record.AggVal,
}
HEADER = bpf_source_dir() / "http_record.h"
# every object-like macro with a value (the include guard has none)
CONSTANTS = re.findall(r"^#define[ \t]+([A-Z][A-Z0-9_]*)[ \t]+\S", HEADER.read_text(), re.M)


@pytest.fixture(scope="module")
def c_contract(tmp_path_factory) -> dict[str, int]:
    """sizeof and offsetof of every field and the value of every #define, as the C compiler
    evaluates the contract header."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to compile the layout probe")
    d = tmp_path_factory.mktemp("layout")
    src = d / "layout.c"
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        "#include <linux/types.h>",
        '#include "http_record.h"',
        "int main(void) {",
        'printf("sizeof %zu\\n", sizeof(struct http_record));',
    ]
    lines += [f'printf("{f} %zu\\n", offsetof(struct http_record, {f}));' for f in FIELDS]
    lines += ['printf("ws_member.sizeof %zu\\n", sizeof(struct ws_member));']
    lines += [
        f'printf("ws_member.{f} %zu\\n", offsetof(struct ws_member, {f}));' for f in MEMBER_FIELDS
    ]
    for struct, fields in (("cuda_block", CUDA_FIELDS), ("cuda_wait", WAIT_FIELDS)):
        lines += [f'printf("{struct}.sizeof %zu\\n", sizeof(struct {struct}));']
        lines += [f'printf("{struct}.{f} %zu\\n", offsetof(struct {struct}, {f}));' for f in fields]
    for cname, struct in SMALL_STRUCTS.items():
        lines += [f'printf("{cname}.sizeof %zu\\n", sizeof(struct {cname}));']
        lines += [
            f'printf("{cname}.{f} %zu\\n", offsetof(struct {cname}, {f}));'
            for f, _ in struct._fields_
        ]
    lines += [f'printf("{c} %lld\\n", (long long)({c}));' for c in CONSTANTS]
    lines += ["return 0; }"]
    src.write_text("\n".join(lines))
    exe = d / "layout"
    subprocess.run(["cc", f"-I{bpf_source_dir()}", "-o", str(exe), str(src)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (line.split() for line in out.splitlines())}


def test_size_and_every_offset_match_c(c_contract):
    assert ctypes.sizeof(HttpRecord) == c_contract["sizeof"]
    for name in FIELDS:
        assert getattr(HttpRecord, name).offset == c_contract[name], name
    assert ctypes.sizeof(WsMember) == c_contract["ws_member.sizeof"]
    for name in MEMBER_FIELDS:
        assert getattr(WsMember, name).offset == c_contract[f"ws_member.{name}"], name
    for struct, cname, fields in (
        (record.CudaBlock, "cuda_block", CUDA_FIELDS),
        (record.CudaWait, "cuda_wait", WAIT_FIELDS),
    ):
        assert ctypes.sizeof(struct) == c_contract[f"{cname}.sizeof"]
        for name in fields:
            assert getattr(struct, name).offset == c_contract[f"{cname}.{name}"], name


def test_the_sampling_and_aggregate_structs_match_c(c_contract):
    for cname, struct in SMALL_STRUCTS.items():
        assert ctypes.sizeof(struct) == c_contract[f"{cname}.sizeof"], cname
        for f, _ in struct._fields_:
            assert getattr(struct, f).offset == c_contract[f"{cname}.{f}"], f"{cname}.{f}"


def test_every_header_constant_has_the_same_value_in_python(c_contract):
    assert {"REC_HTTP", "REQF_TUPLE", "CNT_MAX", "PROG_SCAN_RESP"} <= set(CONSTANTS)
    for name in CONSTANTS:
        assert hasattr(record, name), f"{name} is in http_record.h but not in core/record.py"
        assert getattr(record, name) == c_contract[name], name


def test_python_defines_no_constant_the_header_lacks():
    """Defined once: an upper-case int in core/record.py must come from the header."""
    ours = {k for k, v in vars(record).items() if k.isupper() and isinstance(v, int)}
    assert ours == set(CONSTANTS)


def test_kernel_counter_names_follow_the_cnt_macros():
    """CNT_FOO is exported as kernel_foo: one name per index, each with help text."""
    cnt = {n: getattr(record, n) for n in CONSTANTS if n.startswith("CNT_") and n != "CNT_MAX"}
    assert {v: n.removeprefix("CNT_").lower() for n, v in cnt.items()} == record.KERNEL_COUNTERS
    assert all(i < record.CNT_MAX for i in record.KERNEL_COUNTERS)
    assert set(record.KERNEL_COUNTER_HELP) == set(record.KERNEL_COUNTERS.values())


@pytest.mark.parametrize(
    "struct", [HttpRecord, WsMember, record.CudaBlock, record.CudaWait, *SMALL_STRUCTS.values()]
)
def test_padding_is_explicit(struct):
    # every byte is a named field: no compiler-inserted holes
    end = 0
    for name, ctype in struct._fields_:
        assert getattr(struct, name).offset == end, name
        end += ctypes.sizeof(ctype)
    assert end == ctypes.sizeof(struct)


def test_bpf_sources_ship_with_the_package():
    assert (bpf_source_dir() / "http.c").is_file()
    assert (bpf_source_dir() / "http_record.h").is_file()
    assert Path(str(bpf_source_dir())).is_absolute()


def test_decoder_counts_bad_records():
    m = Metrics()
    dec = RecordDecoder(m)
    assert dec.decode(b"") is None
    assert dec.decode(bytes([99]) + b"\0" * 600) is None
    assert dec.decode(bytes([REC_HTTP]) + b"\0" * 10) is None
    assert m.get("decode_errors", reason="empty") == 1
    assert m.get("decode_errors", reason="unknown_type") == 1
    assert m.get("decode_errors", reason="short") == 1
    good = bytearray(ctypes.sizeof(HttpRecord))
    good[0] = REC_HTTP
    assert isinstance(dec.decode(bytes(good)), HttpRecord)


def test_a_record_ends_after_its_last_used_member():
    """The kernel sends the fixed part and the work-set members the record uses; fewer bytes
    than those is a short record, counted and dropped."""
    m = Metrics()
    dec = RecordDecoder(m)
    full = HttpRecord()
    full.type, full.ws_nslots = REC_HTTP, 2
    full.members[1].tid = 77
    raw = bytes(full)
    member = ctypes.sizeof(WsMember)
    rec = dec.decode(raw[: record.REC_HTTP_FIXED_SIZE + 2 * member])
    assert isinstance(rec, HttpRecord) and rec.members[1].tid == 77
    assert dec.decode(raw[: record.REC_HTTP_FIXED_SIZE + member]) is None  # says 2, holds 1
    full.ws_nslots = 0
    assert isinstance(dec.decode(bytes(full)[: record.REC_HTTP_FIXED_SIZE]), HttpRecord)
    assert dec.decode(bytes(full)[: record.REC_HTTP_FIXED_SIZE - 1]) is None
    assert m.get("decode_errors", reason="short") == 2


def test_a_record_with_cuda_sums_is_sent_whole():
    """WSF_CUDA: the record carries its CUDA block at the end, so it must arrive whole."""
    m = Metrics()
    dec = RecordDecoder(m)
    full = HttpRecord()
    full.type, full.ws_flags = REC_HTTP, record.WSF_CUDA
    full.cuda.own[record.CSIG_MEMCPY_H2D] = 4096
    raw = bytes(full)
    rec = dec.decode(raw)
    assert isinstance(rec, HttpRecord) and rec.cuda.own[record.CSIG_MEMCPY_H2D] == 4096
    assert dec.decode(raw[: record.REC_HTTP_FIXED_SIZE]) is None
    assert dec.decode(raw[:-1]) is None
    assert m.get("decode_errors", reason="short") == 2


@given(st.binary(max_size=2 * ctypes.sizeof(HttpRecord)))
def test_decoder_never_raises(data):
    dec = RecordDecoder(Metrics())
    rec = dec.decode(data)
    if rec is not None:
        assert isinstance(rec, HttpRecord)
        assert rec.method_str().isprintable()
        assert len(rec.method_bytes()) <= HTTP_METHOD_MAX
        original = rec.method_original()
        assert original is None or original.isprintable()
        rec.path_bytes()
        rec.traceparent_bytes()


def test_member_comm_stops_at_nul_and_is_bounded() -> None:
    m = WsMember()
    ctypes.memmove(ctypes.addressof(m) + WsMember.comm.offset, b"worker-1\x00junk", 13)
    assert m.comm_bytes() == b"worker-1"
    ctypes.memmove(ctypes.addressof(m) + WsMember.comm.offset, b"x" * 16, 16)
    assert m.comm_bytes() == b"x" * 16  # a full name has no NUL: the field bounds it


def test_method_and_path_bytes_keep_nul_and_control_bytes() -> None:
    # ctypes c_char fields stop at NUL; the span builder must judge the bytes as sent.
    rec = HttpRecord()
    base = ctypes.addressof(rec)
    ctypes.memmove(base + HttpRecord.method.offset, b"DE\x00\x1bc", 5)
    ctypes.memmove(base + HttpRecord.path.offset, b"/a\x00\x1b", 4)
    rec.method_len, rec.path_len = 5, 4
    assert rec.method_bytes() == b"DE\x00\x1bc"
    assert rec.path_bytes() == b"/a\x00\x1b"
    rec.method_len = 200  # a corrupt length is bounded by the field
    assert len(rec.method_bytes()) == HTTP_METHOD_MAX


def test_methods_outside_the_known_set_are_other_and_kept_only_as_tokens():
    rec = HttpRecord()
    rec.method, rec.method_len = b"GET", 3
    assert (rec.method_str(), rec.method_original()) == ("GET", None)
    rec.flags = record.REQF_METHOD_OTHER
    rec.method, rec.method_len = b"PROPFIND", 8
    assert (rec.method_str(), rec.method_original()) == ("_OTHER", "PROPFIND")
    rec.method, rec.method_len = b"DE\x1bL", 4  # never from the kernel; never passed on
    assert (rec.method_str(), rec.method_original()) == ("_OTHER", None)
    rec.flags = 0
    assert rec.method_str() == "_OTHER"
