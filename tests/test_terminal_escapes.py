"""Issue 18 section 1, end to end: hostile request bytes from a raw TCP client, through the real
kernel probes, the span builder, the capture (its printed output, summary.txt, the spans file),
`tracejoin report` and the console exporter. No output may carry a raw ESC, BEL or C1 control,
and the span holds the percent-encoded path and `_OTHER` for a method outside the known set.
"""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
from pathlib import Path

import pytest
from click.testing import CliRunner
from harness import free_ports, new_traceparent, server
from tracejoin.commands.cli import main

# clear screen, bell, reset, a C1 CSI; then an OSC 52 clipboard write, whose ";c;..." the kernel
# drops with the rest of the segment's ;params (url.path is the path only)
HOSTILE_PATH = b"/\x1b[2J\x07\x1bc\xc2\x9b31m/\x1b]52;c;aGVsbG8=\x07"
ENCODED_PATH = "/%1B[2J%07%1Bc%C2%9B31m/%1B]52"
HOSTILE_METHOD = b"DELE\x1bc"  # the kernel checks a method whole: this opens no request


def assert_inert(what: str, data: bytes) -> None:
    """No character a terminal acts on: C0 controls but LF, DEL, C1 (and valid UTF-8 only, so no
    raw 0x80-0x9f byte either)."""
    bad = [c for c in data.decode("utf-8") if (c < " " and c != "\n") or "\x7f" <= c <= "\x9f"]
    assert not bad, f"{what}: raw control characters {bad!r}"


def send_raw(port: int, method: bytes, path: bytes) -> tuple[str, bytes]:
    """One request exactly as given, on its own connection; returns (trace id, response)."""
    tp, trace_id, _ = new_traceparent()
    req = method + b" " + path + b" HTTP/1.1\r\nHost: t\r\ntraceparent: " + tp.encode()
    req += b"\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(req)
        resp = b""
        while chunk := s.recv(65536):
            resp += chunk
    return f"{trace_id:032x}", resp


def spans_by_trace(path: Path) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for line in path.read_text().splitlines():
        for rs in json.loads(line)["resourceSpans"]:
            for ss in rs["scopeSpans"]:
                for sp in ss["spans"]:
                    if sp["kind"] in (2, "SPAN_KIND_SERVER"):
                        attrs = {
                            a["key"]: next(iter(a["value"].values())) for a in sp["attributes"]
                        }
                        out[sp["traceId"].lower()] = {"name": sp["name"], **attrs}
    return out


@pytest.mark.privileged
def test_hostile_method_and_path_never_reach_a_terminal_raw(
    require_root: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tracejoin.commands.capture import run_capture
    from tracejoin.config import Settings

    # The console exporter as the capture's OTLP destination (OTEL_TRACES_EXPORTER=console; the
    # capture only builds that destination when an endpoint is set, and console ignores it).
    # It writes to sys.stdout, looked up at export time.
    console = io.StringIO()
    monkeypatch.setattr(sys, "stdout", console)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")

    (port,) = free_ports(1)
    sent: dict[str, str] = {}
    responses: list[bytes] = []
    errors: list[BaseException] = []

    def traffic() -> None:
        try:
            for label, method, path in (
                ("method", HOSTILE_METHOD, b"/x"),
                ("path", b"GET", HOSTILE_PATH),
                ("both", HOSTILE_METHOD, HOSTILE_PATH),
            ):
                trace_id, resp = send_raw(port, method, path)
                sent[label] = trace_id
                responses.append(resp)
        except BaseException as e:  # reported below, not lost in the thread
            errors.append(e)

    printed = io.StringIO()
    worker = threading.Thread(target=traffic, daemon=True)
    with server("threaded", port) as srv:
        s = Settings(pid=(srv.pid,), port=(port,), duration=3.0, output_dir=tmp_path)
        rc = run_capture(s, printed, on_ready=worker.start)
        worker.join(10)
    assert not errors, errors
    assert rc == 0, printed.getvalue()
    assert all(r.startswith(b"HTTP/1.") for r in responses), responses

    spans = spans_by_trace(tmp_path / "spans.otlp.jsonl")
    path_span = spans[sent["path"]]
    assert path_span["url.path"] == ENCODED_PATH
    assert path_span["http.request.method"] == "GET"
    assert path_span["name"] == f"GET {ENCODED_PATH}"
    # The kernel may drop a request whose method is not whole and known (the stricter kernel
    # check); whatever it passes, user space makes the method `_OTHER`, with no original: a
    # method holding ESC is not a token.
    for label in ("method", "both"):
        span = spans.get(sent[label])
        if span is None:
            continue
        assert span["http.request.method"] == "_OTHER"
        assert "http.request.method_original" not in span
        want = "/x" if label == "method" else ENCODED_PATH
        assert span["url.path"] == want and span["name"] == f"HTTP {want}"

    summary_txt = (tmp_path / "summary.txt").read_bytes()
    report = CliRunner().invoke(main, ["report", str(tmp_path)])
    assert report.exit_code == 0, report.output
    for what, data in (
        ("capture output", printed.getvalue().encode()),
        ("summary.txt", summary_txt),
        ("tracejoin report", report.output.encode()),
        ("console exporter", console.getvalue().encode()),
        ("spans file", (tmp_path / "spans.otlp.jsonl").read_bytes()),
    ):
        assert_inert(what, data)
    assert f"GET {ENCODED_PATH}" in summary_txt.decode()
    assert report.output == summary_txt.decode()
    assert summary_txt.decode().strip() in printed.getvalue()
    console_line = next(x for x in console.getvalue().splitlines() if x.startswith(sent["path"]))
    assert f" GET {ENCODED_PATH} " in console_line
