"""The capture summary: per endpoint, where the time went; the slowest requests by trace id;
the loss counters. Computed from server spans, so `tracejoin report` can recompute it from the
saved OTLP-JSON file exactly as `capture` printed it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from agent.model import KIND_SERVER, STATUS_ERROR, Span

WIDTH = 100
CELL = 10  # one component column: "p50/p99"

# (column, attribute, scale to the shown unit)
COMPONENTS: tuple[tuple[str, str, float], ...] = (
    ("recvq ms", "tracejoin.tcp.receive_queue_wait_ns", 1e-6),
    ("runq ms", "tracejoin.sched.runq_wait_ns", 1e-6),
    ("minflt", "tracejoin.mm.minor_faults", 1.0),
    ("majflt", "tracejoin.mm.major_faults", 1.0),
    ("tlb", "tracejoin.tlb.flushes", 1.0),
    ("dtlb", "tracejoin.tlb.dtlb_load_misses", 1.0),
    ("gpu busy", "gpu.kernel_active.ratio.avg", 100.0),
)


@dataclass(frozen=True, slots=True)
class Row:
    name: str
    trace_id: str
    duration_ns: int
    error: bool
    attributes: dict[str, object]


@dataclass
class Summary:
    rows: list[Row] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)

    def add_span(self, span: Span) -> None:
        if span.kind != KIND_SERVER:
            return
        status = span.attributes.get("http.response.status_code", 0)
        self.rows.append(
            Row(
                span.name,
                span.trace_id_hex,
                span.duration_ns,
                span.status_code == STATUS_ERROR or (isinstance(status, int) and status >= 500),
                dict(span.attributes),
            )
        )

    def to_json(self) -> dict[str, object]:
        return {"counters": self.counters, "requests": len(self.rows)}

    def format(self, slowest: int = 5) -> str:
        lines: list[str] = []
        if not self.rows:
            lines.append(
                "No HTTP requests were seen. Check the filters (--pid/--port/--comm) "
                "and that traffic reached this host during the capture."
            )
        else:
            lines.extend(self._endpoint_table())
            lines.append("")
            lines.append(
                f"Slowest {min(slowest, len(self.rows))} requests (open the trace id in Jaeger):"
            )
            for row in sorted(self.rows, key=lambda r: -r.duration_ns)[:slowest]:
                lines.append(f"  {row.duration_ns / 1e6:10.2f} ms  {row.trace_id}  {row.name[:44]}")
        lines.append("")
        lines.append("Losses:")
        lines.extend("  " + part for part in _fmt_counters(self.counters))
        return "\n".join(line[:WIDTH] for line in lines)

    def _endpoint_table(self) -> list[str]:
        groups: dict[str, list[Row]] = {}
        for row in self.rows:
            groups.setdefault(row.name, []).append(row)
        # At most four components fit beside the latency columns in 100 columns; the ones with
        # data win, in COMPONENTS order (queueing first: it is what operators look for first).
        present = [c for c in COMPONENTS if any(c[1] in r.attributes for r in self.rows)][:4]
        head = f"{'endpoint':<28}{'count':>6}{'err':>5}{'p50 ms':>9}{'p99 ms':>9}"
        for col, _, _ in present:
            head += f"{col:>{CELL}}"
        out = [
            head,
            " " * 57 + f"{'(p50/p99)':>{CELL}}" * len(present) if present else "",
            "-" * len(head),
        ]
        for name, rows in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            durs = sorted(r.duration_ns / 1e6 for r in rows)
            line = (
                f"{name[:27]:<28}{len(rows):>6}{sum(r.error for r in rows):>5}"
                f"{_pct(durs, 50):>9.2f}{_pct(durs, 99):>9.2f}"
            )
            for _col, attr, scale in present:
                vals = sorted(
                    float(r.attributes[attr]) * scale  # type: ignore[arg-type]
                    for r in rows
                    if attr in r.attributes
                )
                cell = f"{_short(_pct(vals, 50))}/{_short(_pct(vals, 99))}" if vals else "-"
                line += f"{cell:>{CELL}}"
            out.append(line)
        return out


def _short(v: float) -> str:
    if v == int(v) or v >= 100:
        return f"{v:.0f}"
    return f"{v:.2f}"


def _pct(sorted_vals: list[float], p: float) -> float:
    """Nearest-rank percentile."""
    if not sorted_vals:
        return 0.0
    k = max(0, min(len(sorted_vals) - 1, round(p / 100 * len(sorted_vals) + 0.5) - 1))
    return sorted_vals[k]


LOSS_COUNTERS = (
    ("kernel_ringbuf_full", "records the kernel could not queue (ring buffer full)"),
    ("records_dropped_userspace", "records read but not turned into spans"),
    ("spans_dropped", "spans not delivered to a destination"),
    ("decode_errors", "malformed records"),
    ("kernel_request_state_lost", "requests whose kernel state was evicted"),
    ("kernel_pipeline_slots_full", "pipelined requests beyond the per-connection limit"),
)


def _fmt_counters(counters: dict[str, float]) -> list[str]:
    return [f"{int(counters.get(k, 0)):>8}  {what}" for k, what in LOSS_COUNTERS]


def rows_from_otlp_json(lines: Iterable[str]) -> list[Row]:
    """Server-span rows from OTLP/JSON ExportTraceServiceRequest lines."""
    rows = []
    for line in lines:
        if not line.strip():
            continue
        req = json.loads(line)
        for rs in req.get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for sp in ss.get("spans", []):
                    if sp.get("kind") != KIND_SERVER:
                        continue
                    attrs = {
                        a["key"]: _json_value(a.get("value", {})) for a in sp.get("attributes", [])
                    }
                    dur = int(sp["endTimeUnixNano"]) - int(sp["startTimeUnixNano"])
                    status = attrs.get("http.response.status_code", 0)
                    err = sp.get("status", {}).get("code") == STATUS_ERROR or (
                        isinstance(status, int) and status >= 500
                    )
                    rows.append(Row(sp["name"], sp["traceId"], dur, err, attrs))
    return rows


def _json_value(v: dict[str, object]) -> object:
    if "intValue" in v:
        return int(v["intValue"])  # type: ignore[call-overload]
    for k in ("stringValue", "boolValue", "doubleValue"):
        if k in v:
            return v[k]
    return None


def load_report(path: Path) -> Summary:
    """Summary from a capture directory (or its spans file)."""
    spans_file = path / "spans.otlp.jsonl" if path.is_dir() else path
    with spans_file.open() as fh:
        summary = Summary(rows=rows_from_otlp_json(fh))
    counters_file = spans_file.parent / "counters.json"
    if counters_file.exists():
        summary.counters = json.loads(counters_file.read_text())
    return summary
