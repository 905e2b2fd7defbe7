"""Local senders: an OTLP/JSON-lines file (the default with no endpoint) and a console printer."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Sequence
from typing import IO, TextIO

from tracejoin.core.files import open_private
from tracejoin.core.model import STATUS_ERROR, STATUS_OK, Span
from tracejoin.core.text import terminal_safe
from tracejoin.exporters.base import ExportResult
from tracejoin.exporters.otlp_json import encode_request_json


class JsonLinesFileExporter:
    """Appends one OTLP/JSON ExportTraceServiceRequest per line and flushes after each batch, so
    a reader (or `tracejoin.exporters.otlp_json.decode_request_json`) sees whole requests only."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._file: IO[str] | None = None
        self._lock = threading.Lock()
        self._closed = False

    def export(self, spans: Sequence[Span], timeout_s: float | None = None) -> ExportResult:
        if not spans:
            return ExportResult.SUCCESS
        line = encode_request_json(spans) + "\n"
        with self._lock:
            if self._closed:
                return ExportResult.fail("exporter is shut down")
            try:
                if self._file is None:
                    # A lone surrogate (from undecodable input) becomes "?", not a failed batch.
                    self._file = open_private(self.path, "a", errors="replace")  # 0600, no symlinks
                self._file.write(line)
                self._file.flush()
            except OSError as err:  # disk full, directory gone: may clear up
                return ExportResult.retry(f"write {self.path}: {err}")
        return ExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            f, self._file = self._file, None
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()

    def __repr__(self) -> str:
        return f"JsonLinesFileExporter({self.path!r})"


_STATUS_NAMES = {STATUS_OK: "OK", STATUS_ERROR: "ERROR"}


def console_line(span: Span) -> str:
    """One line for a terminal: the name and status message come from HTTP clients, so every
    control character in them is escaped (a path can carry ESC sequences)."""
    status = _STATUS_NAMES.get(span.status_code, "UNSET")
    if span.status_message:
        status += f" ({span.status_message})"
    ms = span.duration_ns / 1e6
    line = f"{span.trace_id_hex} {span.span_id_hex} {span.name} {ms:.3f} ms {status}"
    return terminal_safe(line)


class ConsoleExporter:
    """One short human-readable line per span: trace id, span id, name, duration, status."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Span], timeout_s: float | None = None) -> ExportResult:
        stream = self._stream or sys.stdout  # looked up late: tests swap sys.stdout
        text = "".join(console_line(s) + "\n" for s in spans)
        with self._lock:
            try:
                stream.write(text)
                stream.flush()
            except (OSError, ValueError) as err:  # closed or broken pipe
                return ExportResult.fail(f"console: {err}")
        return ExportResult.SUCCESS

    def shutdown(self) -> None:
        pass
