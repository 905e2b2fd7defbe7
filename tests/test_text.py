"""Issue 18 section 1: client-controlled bytes -> safe text (tracejoin.core.text), and the places
that print it to a terminal (summary, report, console exporter). Pure logic; the end-to-end test
with real BPF is tests/test_terminal_escapes.py."""

from __future__ import annotations

import io
import json
import re
import unicodedata
from pathlib import Path
from urllib.parse import unquote_to_bytes

from click.testing import CliRunner
from hypothesis import example, given
from hypothesis import strategies as st
from tracejoin.commands.cli import main
from tracejoin.commands.summary import Summary
from tracejoin.core.model import KIND_SERVER, STATUS_ERROR, Resource, Span
from tracejoin.core.text import (
    KNOWN_METHODS,
    METHOD_ORIGINAL_MAX,
    OTHER_METHOD,
    http_method,
    terminal_safe,
    url_path,
)
from tracejoin.exporters.file_sender import ConsoleExporter, JsonLinesFileExporter

TCHARS = "!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
# What no terminal output and no url.path may contain: C0, DEL, C1, and the layout controls.
BIDI_AND_SEPARATORS = "\u061c\u200e\u200f\u2028\u2029\u202a\u202b\u202c\u202d\u202e"
BIDI_AND_SEPARATORS += "\u2066\u2067\u2068\u2069"
HOSTILE_PATH = b"/\x1b]52;c;aGVsbG8=\x07\x1b[2J\xc2\x9b31m"


def unsafe_chars(s: str) -> list[str]:
    return [
        c
        for c in s
        if ord(c) < 0x20
        or 0x7F <= ord(c) <= 0x9F
        or c in BIDI_AND_SEPARATORS
        or unicodedata.category(c) == "Cs"
    ]


def unescape(s: str) -> str:
    return re.sub(r"\\x([0-9a-f]{2})|\\u([0-9a-f]{4})", lambda m: chr(int(m[1] or m[2], 16)), s)


# ---- http_method -------------------------------------------------------------------------


def test_known_methods_pass_unchanged() -> None:
    assert {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE"} < KNOWN_METHODS
    assert {"PATCH", "QUERY"} < KNOWN_METHODS
    for m in KNOWN_METHODS:
        assert http_method(m.encode()) == (m, None)


def test_other_methods() -> None:
    assert http_method(b"DELE\x1bc") == (OTHER_METHOD, None)  # the hostile method
    assert http_method(b"get") == (OTHER_METHOD, "get")  # case-sensitive, like the conventions
    assert http_method(b"PROPFIND") == (OTHER_METHOD, "PROPFIND")
    assert http_method(b"M-SEARCH") == (OTHER_METHOD, "M-SEARCH")
    assert http_method(b"") == (OTHER_METHOD, None)
    assert http_method(b"GE T") == (OTHER_METHOD, None)
    assert http_method(b"GET\x00") == (OTHER_METHOD, None)
    assert http_method(b"G\xc3\x89T") == (OTHER_METHOD, None)
    assert http_method(b"A" * METHOD_ORIGINAL_MAX) == (OTHER_METHOD, "A" * METHOD_ORIGINAL_MAX)
    assert http_method(b"A" * (METHOD_ORIGINAL_MAX + 1)) == (OTHER_METHOD, None)


@given(st.binary(max_size=40))
@example(b"DELE\x1bc")
def test_http_method_values_are_always_safe(raw: bytes) -> None:
    method, original = http_method(raw)
    if method != OTHER_METHOD:
        assert method in KNOWN_METHODS and original is None and raw == method.encode()
    else:
        assert raw.decode("latin-1") not in KNOWN_METHODS
    if original is not None:
        assert original.encode() == raw  # the original, never an altered one
        assert 1 <= len(original) <= METHOD_ORIGINAL_MAX
        assert set(original) <= set(TCHARS)


@given(st.text(TCHARS, min_size=1, max_size=METHOD_ORIGINAL_MAX))
def test_every_unknown_token_is_kept_as_the_original(token: str) -> None:
    expected = (token, None) if token in KNOWN_METHODS else (OTHER_METHOD, token)
    assert http_method(token.encode()) == expected


# ---- url_path ----------------------------------------------------------------------------


def test_url_path_examples() -> None:
    assert url_path(HOSTILE_PATH) == "/%1B]52;c;aGVsbG8=%07%1B[2J%C2%9B31m"
    assert url_path(b"/users/42/orders") == "/users/42/orders"
    assert url_path(b"/caf\xc3\xa9") == "/café"  # valid UTF-8 stays readable
    assert url_path(b"/a%20b%2Fc") == "/a%20b%2Fc"  # already encoded: not encoded again
    assert url_path(b"/100%") == "/100%25"  # a lone % becomes unambiguous
    assert url_path(b"/%zz/%4") == "/%25zz/%254"
    assert url_path(b"/a b\tc\x7f") == "/a%20b%09c%7F"
    assert url_path(b"/\xff\xc3") == "/%FF%C3"  # invalid and truncated UTF-8
    assert url_path(b"/\xed\xa0\x80") == "/%ED%A0%80"  # an encoded surrogate is invalid UTF-8
    assert url_path("/x\u202ey\u2028".encode()) == "/x%E2%80%AEy%E2%80%A8"
    assert url_path(b"") == ""


@given(st.binary(max_size=120))
@example(HOSTILE_PATH)
@example(b"/%1B\x1b%")
def test_url_path_is_safe_and_decodes_like_the_wire(raw: bytes) -> None:
    path = url_path(raw)
    assert not unsafe_chars(path)
    assert " " not in path
    path.encode("utf-8")  # strict: no lone surrogate left
    assert all(re.match(r"%[0-9A-Fa-f]{2}", path[i:]) for i, c in enumerate(path) if c == "%")
    # The same bytes as the wire after percent-decoding: a raw ESC and %1B are the same path.
    assert unquote_to_bytes(path) == unquote_to_bytes(raw)
    assert url_path(path.encode()) == path  # idempotent: never double-encoded
    assert terminal_safe(path) == path


@given(st.text(TCHARS + "/:@=;,~()[]", max_size=60))
def test_url_path_keeps_clean_paths(text: str) -> None:
    # Printable ASCII without a lone % is returned exactly as sent.
    text = re.sub(r"%(?![0-9A-Fa-f]{2})", "", text)
    assert url_path(text.encode()) == text


# ---- terminal_safe -----------------------------------------------------------------------


def test_terminal_safe_examples() -> None:
    assert terminal_safe("GET /\x1b]52;c;aGVsbG8=\x07\x1b[2J") == (
        "GET /\\x1b]52;c;aGVsbG8=\\x07\\x1b[2J"
    )
    assert terminal_safe("a\u009bb\u009dc\x7f") == "a\\u009bb\\u009dc\\x7f"
    assert terminal_safe("line\r\nforged\tcol") == "line\\x0d\\x0aforged\\x09col"
    assert terminal_safe("\u202eevil\ud800") == "\\u202eevil\\ud800"
    assert terminal_safe("GET /café/{id} 日本 C:\\dir") == "GET /café/{id} 日本 C:\\dir"


@given(st.text())
@example("\x1b[2J\u009b\u0085\u2028")
def test_terminal_safe_output_is_inert(s: str) -> None:
    out = terminal_safe(s)
    assert not unsafe_chars(out)
    out.encode("utf-8")  # printable on any UTF-8 terminal, even from a lone surrogate
    assert terminal_safe(out) == out
    if "\\" not in s:
        assert unescape(out) == s  # nothing lost: each escape stands for one character


@given(st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Zl", "Zp"))))
def test_terminal_safe_keeps_printable_text(s: str) -> None:
    assert terminal_safe(s) == s


# ---- where text reaches a terminal ---------------------------------------------------------

HOSTILE_NAME = "GET /\x1b]52;c;aGVsbG8=\x07\x1b[2J\u009b31m\r\nfake line"


def _span(name: str, trace_id: int = 0xABC) -> Span:
    return Span(
        trace_id=trace_id,
        span_id=0x1,
        parent_span_id=0,
        name=name,
        kind=KIND_SERVER,
        start_ns=1_000_000,
        end_ns=3_000_000,
        resource=Resource((("service.name", "srv\x1b[31m"),)),
        attributes={"http.response.status_code": 500},
        status_code=STATUS_ERROR,
        status_message="closed\x1b[2J",
    )


def test_summary_escapes_names_in_every_section() -> None:
    s = Summary()
    s.add_span(_span(HOSTILE_NAME))
    s.add_span(_span("GET /x\x1b", trace_id=0xDEF))
    s.info = {"duration_s": 1.0, "filters": "comm \x1b]0;title\x07", "stopped_by": "SIGINT"}
    s.counters = {"spans_dropped{exporter=\x1b[2J}": 1.0, "spans_dropped": 1.0}
    text = s.format()
    assert not unsafe_chars(text.replace("\n", ""))
    assert "\\x1b]52;c;aGVsbG8=\\x07\\x1b[2J\\u009b31m" in text
    assert "fake line" in text and "\nfake line" not in text  # no forged line
    assert "\\x1b]0;title\\x07" in text and "{exporter=\\x1b[2J}" in text
    # the short hostile name still fits the table's name column, escaped
    row = next(line for line in text.splitlines() if line.startswith("GET /x\\x1b"))
    assert row.split()[:3] == ["GET", "/x\\x1b", "1"]
    assert all(len(line) <= 100 for line in text.splitlines())


def test_console_exporter_escapes() -> None:
    out = io.StringIO()
    ConsoleExporter(out).export([_span(HOSTILE_NAME)])
    line = out.getvalue()
    assert line.endswith("\n") and line.count("\n") == 1
    assert not unsafe_chars(line[:-1])
    assert "\\x1b]52;c;aGVsbG8=" in line and "(closed\\x1b[2J)" in line


def test_report_escapes_a_hostile_spans_file(tmp_path: Path) -> None:
    """`tracejoin report` may be pointed at a file from anywhere: JSON escapes decode to raw
    controls (and to lone surrogates, which would crash the print) and must come out escaped."""
    exp = JsonLinesFileExporter(tmp_path / "spans.otlp.jsonl")
    exp.export([_span(HOSTILE_NAME)])
    exp.shutdown()
    crafted = {
        "resourceSpans": [
            {
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": "00000000000000000000000000000def",
                                "name": "GET /\u009b2J\ud800",
                                "kind": "SPAN_KIND_SERVER",
                                "startTimeUnixNano": "1",
                                "endTimeUnixNano": "2",
                                "attributes": [],
                            }
                        ]
                    }
                ]
            }
        ]
    }
    with (tmp_path / "spans.otlp.jsonl").open("a") as f:
        f.write(json.dumps(crafted) + "\n")  # ensure_ascii: "\\u001b", "\\ud800" on disk
    res = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert not unsafe_chars(res.output.replace("\n", ""))
    assert "\\x1b]52;c;aGVsbG8=\\x07" in res.output and "GET /\\u009b2J\\ud800" in res.output
    # an error that quotes the file is escaped too
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"resourceSpans": [{"scopeSpans": [{"spans": [{"kind": 2, "x\\u001b[2J": 1}]}]}]}\n'
    )
    res = CliRunner().invoke(main, ["report", str(bad)])
    assert res.exit_code != 0 and "malformed" in res.output
    assert not unsafe_chars(res.output.replace("\n", ""))
