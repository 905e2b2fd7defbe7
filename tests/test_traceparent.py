"""The W3C traceparent rules (shared/TRACEPARENT.md) on the parser alone, plus properties."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tracejoin.enrich import traceparent as tp

TID = "4bf92f3577b34da6a3ce929d0e0e4736"
PID = "00f067aa0ba902b7"


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (f"00-{TID}-{PID}-01", (int(TID, 16), int(PID, 16), 1)),
        (f"00-{TID}-{PID}-00", (int(TID, 16), int(PID, 16), 0)),
        (f"00-{TID}-{PID}-ff", (int(TID, 16), int(PID, 16), 0xFF)),
        (f"01-{TID}-{PID}-01", (int(TID, 16), int(PID, 16), 1)),
        (f"cc-{TID}-{PID}-01-extra", (int(TID, 16), int(PID, 16), 1)),
        (f"ff-{TID}-{PID}-01", tp.BAD_VERSION),
        (f"00-{TID}-{PID}-01-", tp.TOO_LONG),
        (f"00-{TID}-{PID}-01.", tp.TOO_LONG),
        (f"cc-{TID}-{PID}-01.x", tp.MALFORMED),
        (f"00-{TID.upper()}-{PID}-01", tp.UPPERCASE),
        (f"0A-{TID}-{PID}-01", tp.UPPERCASE),
        (f"00-{'0' * 32}-{PID}-01", tp.ZERO_TRACE_ID),
        (f"00-{TID}-{'0' * 16}-01", tp.ZERO_PARENT_ID),
        (f"00-{TID}-{PID}-0", tp.TRUNCATED),
        ("", tp.TRUNCATED),
        (f"00-{TID}-{PID}+01", tp.MALFORMED),
        (f"00-{TID[:-1]}z-{PID}-01", tp.MALFORMED),
        (f"00-{TID}-{PID}-0g", tp.MALFORMED),
    ],
)
def test_parse(value, expected):
    got = tp.parse(value.encode())
    if isinstance(expected, tuple):
        assert isinstance(got, tp.TraceParent)
        assert (got.trace_id, got.parent_id, got.flags) == expected
    else:
        assert got == expected


def test_sampled_flag_is_bit_zero():
    assert tp.parse(f"00-{TID}-{PID}-01".encode()).sampled  # type: ignore[union-attr]
    assert not tp.parse(f"00-{TID}-{PID}-02".encode()).sampled  # type: ignore[union-attr]


def test_prefix_with_total_length():
    # the kernel hands over 56 bytes and the full length
    value = f"cc-{TID}-{PID}-01-" + "x" * 200
    assert isinstance(tp.parse(value[:56].encode(), total_len=len(value)), tp.TraceParent)
    v00 = f"00-{TID}-{PID}-01"
    assert tp.parse(v00.encode(), total_len=57) == tp.TOO_LONG


def test_header_level_rules():
    good = f"00-{TID}-{PID}-01".encode()
    assert tp.parse_header_values([]) is None
    assert tp.parse_header_values([good, good]) == tp.DUPLICATE
    assert isinstance(tp.parse_header_values([b" \t" + good + b" "]), tp.TraceParent)


def _reference_ok(v: bytes) -> bool:
    """An independent statement of the version-00/future rules, for the property test."""
    hexd = set(b"0123456789abcdef")
    if len(v) < 55 or v[2:3] != b"-" or v[35:36] != b"-" or v[52:53] != b"-":
        return False
    if not all(c in hexd for c in v[0:2] + v[3:35] + v[36:52] + v[53:55]):
        return False
    if v[0:2] == b"ff" or int(v[3:35], 16) == 0 or int(v[36:52], 16) == 0:
        return False
    if v[0:2] == b"00":
        return len(v) == 55
    return len(v) == 55 or v[55:56] == b"-"


hexchars = st.sampled_from("0123456789abcdefABCDEF-xg ")
near_valid = st.builds(
    lambda ver, t, p, f, tail: f"{ver}-{t}-{p}-{f}{tail}".encode(),
    st.text(hexchars, min_size=2, max_size=2),
    st.text(hexchars, min_size=31, max_size=33),
    st.text(hexchars, min_size=15, max_size=17),
    st.text(hexchars, min_size=1, max_size=3),
    st.sampled_from(["", "-", ".", "-abc", "x"]),
)


@given(st.one_of(st.binary(max_size=120), near_valid))
def test_never_raises_and_never_accepts_what_the_rules_reject(value):
    got = tp.parse(value)
    assert isinstance(got, tp.TraceParent) or got in tp.REASONS
    assert isinstance(got, tp.TraceParent) == _reference_ok(value)


# ------------------------------------------------ the compiled common case (_trace_context.c)

_VALID = f"00-{TID}-{PID}-01".encode()
_MUTANT_BYTES = b"0123456789abcdefABCDEFg- \t\x00\xff"


def _record_with(value: bytes, count: int = 1, h2_flags: int = 0):
    import ctypes

    from records import record
    from tracejoin.core.record import HttpRecord

    r = record()
    raw = value[:56].ljust(56, b"\0")
    ctypes.memmove(ctypes.addressof(r) + HttpRecord.tp.offset, raw, 56)
    r.tp_len, r.tp_count, r.h2_flags = min(len(value), 0xFFFF), count, h2_flags
    return r


def _compiled_agrees(value: bytes) -> None:
    """It accepts exactly the valid version-00 values, as parse reads them, and abstains on
    everything else (parse decides those: a later version, every rejection)."""
    from tracejoin.enrich import correlate

    assert correlate._plain_traceparent is not None, "_trace_context.c was not built"
    got = correlate._plain_traceparent(_record_with(value))
    ref = tp.parse(value[:56], total_len=len(value))
    if isinstance(ref, tp.TraceParent) and value[:2] == b"00":
        assert got == (ref.trace_id, ref.parent_id, ref.flags)
    else:
        assert got is None, (value, ref)


@given(
    st.lists(st.tuples(st.integers(0, 56), st.sampled_from(list(_MUTANT_BYTES))), max_size=3),
    st.integers(40, 60),
)
def test_the_compiled_common_case_accepts_only_what_parse_accepts(edits, length):
    value = bytearray(_VALID.ljust(60, b"-")[:length])
    for at, byte in edits:
        if at < len(value):
            value[at] = byte
    _compiled_agrees(bytes(value))


@given(st.binary(max_size=60))
def test_the_compiled_common_case_abstains_on_arbitrary_bytes(value):
    _compiled_agrees(value)


@pytest.mark.parametrize(
    "value",
    [
        _VALID,
        f"00-{TID}-{PID}-00".encode(),
        f"00-{TID}-{PID}-ff".encode(),
        f"00-{'0' * 31}1-{PID}-01".encode(),  # trace id 1: only its low half set
        f"00-1{'0' * 31}-{PID}-01".encode(),  # ... only its high half
        f"01-{TID}-{PID}-01".encode(),  # a later version: parse's
        f"00-{TID.upper()}-{PID}-01".encode(),
        f"00-{'0' * 32}-{PID}-01".encode(),
        f"00-{TID}-{'0' * 16}-01".encode(),
        _VALID + b"-",
        _VALID[:-1],
        # each dash, and each byte around it, replaced by a hex digit
        *(_VALID[:i] + b"0" + _VALID[i + 1 :] for i in (1, 2, 3, 34, 35, 36, 51, 52, 53)),
        *(_VALID[:i] + b"g" + _VALID[i + 1 :] for i in (0, 3, 18, 19, 34, 36, 51, 53, 54)),
    ],
)
def test_the_compiled_common_case_on_the_rules_edges(value):
    _compiled_agrees(value)


def test_the_compiled_common_case_leaves_duplicates_and_huffman_to_python():
    from tracejoin.core.record import H2F_TP_HUFF
    from tracejoin.enrich import correlate

    plain = correlate._plain_traceparent
    assert plain is not None
    assert plain(_record_with(_VALID)) is not None
    assert plain(_record_with(_VALID, count=2)) is None  # parse: duplicate
    assert plain(_record_with(_VALID, count=0)) is None
    assert plain(_record_with(_VALID, h2_flags=H2F_TP_HUFF)) is None  # not decoded yet
    assert correlate.trace_context(_record_with(_VALID, count=2)) == tp.DUPLICATE
    with pytest.raises(ValueError):
        plain(b"\0" * 10)
