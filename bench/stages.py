"""The agent's user-space stages, one by one, on a synthetic record (no kernel, no threads).

    python -m bench.stages
    python -m bench.stages --records PATH   # live records from bench.profile_agent --save-records
    python -m bench.stages --records PATH --encoder join|python   # ... on another span writer

One realistic record (GET with a valid sampled traceparent, tuple known, receive-queue wait,
TLB flush fallback: what the Go server produces) goes through each stage of `tracejoin run` in a
tight loop: decode, enrichment (traceparent validation inside), span building, metrics, and the
encoders (OTLP-JSON for the file destination `tracejoin run` writes in bench/run.py, OTLP
protobuf for the OTLP destinations). CPU µs per record, best of 3. What the live agent spends
beyond their sum is the ring read (the compiled consumer, or BCC's ctypes callback per record
where it was not built), the queues, the threads, and caches cold after each sleep (POLL_MS) (the
replay of live records measured ~2x below the live agent's per-record CPU: docs/performance.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tracejoin.config import Settings
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import Resource
from tracejoin.core.record import H2F_STREAM
from tracejoin.enrich import traceparent
from tracejoin.enrich.enricher import EnrichedRecord, Enricher
from tracejoin.exporters.otlp_json import encode_request_json
from tracejoin.exporters.otlp_proto import encode_request_bytes
from tracejoin.kernel.decode import (
    REC_HTTP,
    REQF_FIRST_ON_CONN,
    REQF_TUPLE,
    HttpRecord,
    RecordDecoder,
)
from tracejoin.pipeline import span_bytes
from tracejoin.pipeline.span_bytes import BatchWriter, encode_spans
from tracejoin.pipeline.spans import SpanOptions, build_spans

TP = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
BATCH = 512  # records per encoded request (the queue's default batch)


def sample_record() -> bytes:
    r = HttpRecord()
    r.type, r.family = REC_HTTP, socket.AF_INET
    r.method, r.method_len = b"GET", 3
    r.path, r.path_len = b"/api/items/123", 14
    r.tp, r.tp_len, r.tp_count = TP, len(TP), 1
    r.flags = REQF_TUPLE | REQF_FIRST_ON_CONN
    r.status, r.lport, r.rport = 200, 8080, 40000
    r.laddr[:4] = [127, 0, 0, 1]
    r.raddr[:4] = [127, 0, 0, 1]
    r.pid = r.tid = os.getpid()
    now = time.monotonic_ns()
    r.est_ns, r.arrival_ns, r.read_ns = now - 60_000, now - 50_000, now - 40_000
    r.resp_start_ns, r.end_ns = now - 10_000, now
    r.nr_switches, r.minflt = 2, 3
    return bytes(r)


def sample_h2_record() -> bytes:
    """The same request as an HTTP/2 gRPC stream that ended with grpc-status 0."""
    r = HttpRecord.from_buffer_copy(sample_record())
    path = b"/tj.Echo/Say"
    r.path, r.path_len = path, len(path)
    r.method, r.method_len = b"POST", 4
    r.h2_flags, r.grpc_status, r.seq = H2F_STREAM, 1, 7
    return bytes(r)


def agent_span_options() -> SpanOptions:
    """The span options `tracejoin run` uses by default on this kind of host (no PMU, no
    work set in the record): its default thresholds for child spans."""
    d = Settings()
    return SpanOptions(
        frozenset({"recvq", "tcp_stats", "sched", "page_faults", "tlb_flush"}),
        "flush_fallback",
        int(d.runq_threshold_ms * 1e6),
        int(d.recvq_threshold_ms * 1e6),
    )


def _best_us(fn: Callable[[], object], n: int, per: int = 1) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - t0) / n)
    return best * 1e6 / per


def _with_encoder(which: str, measure: Callable[[], float]) -> float:
    span_bytes.use_encoder(which)
    try:
        return measure()
    finally:
        span_bytes.use_encoder("compiled")


BATCH_ROW = "batch writer: decode+enrich+encode_spans, one call"


def run(n: int = 20_000) -> dict[str, Any]:
    metrics = Metrics()
    raw = sample_record()
    decoder = RecordDecoder(metrics)
    rec = decoder.decode(raw)
    assert isinstance(rec, HttpRecord)
    resource = Resource((("service.name", "bench"),))
    enricher = Enricher(metrics, lambda _pid: resource)
    opts = agent_span_options()
    e = enricher.enrich(rec)
    assert e is not None
    spans = build_spans(e, opts, enricher.new_id)
    per_batch = spans * BATCH
    encoded_batch = encode_spans(e, opts, enricher.new_id) * BATCH
    reps = max(3, n // 1000)
    h2 = enricher.enrich(decoder.decode(sample_h2_record()))  # type: ignore[arg-type]
    assert h2 is not None

    def on_writers(er: EnrichedRecord, rows: tuple[tuple[str, str], ...]) -> dict[str, float]:
        """encode_spans of `er` on each (label, writer): what each compiled piece buys. No rows
        where the compiled module was not built (the other writers need it)."""
        if not span_bytes.COMPILED:
            return {}
        return {
            label: _with_encoder(
                which, lambda: _best_us(lambda: encode_spans(er, opts, enricher.new_id), n)
            )
            for label, which in rows
        }

    stages = {
        "decode (bytes -> HttpRecord)": _best_us(lambda: decoder.decode(raw), n),
        "traceparent.parse (inside enrich)": _best_us(
            lambda: traceparent.parse(TP, total_len=len(TP)), n
        ),
        "Enricher.enrich": _best_us(lambda: enricher.enrich(rec), n),
        "build_spans": _best_us(lambda: build_spans(e, opts, enricher.new_id), n),
        "Metrics.inc x2 (records_received, spans_built)": 2
        * _best_us(lambda: metrics.inc("spans_built", 2), n),
        "OTLP-JSON encode (file destination)": _best_us(
            lambda: encode_request_json(per_batch), reps, BATCH
        ),
        "OTLP protobuf encode (OTLP destinations)": _best_us(
            lambda: encode_request_bytes(per_batch), reps, BATCH
        ),
        # the object-free path `tracejoin run` takes when every destination is OTLP
        "encode_spans (server span -> bytes, no objects)": _best_us(
            lambda: encode_spans(e, opts, enricher.new_id), n
        ),
        **on_writers(
            e,
            (
                # the Python encoder on the compiled join (before the compiled server span)
                ("the same, Python encoder on the compiled join", "join"),
                ("the same, on the pure-Python join (no compiler)", "python"),
            ),
        ),
        "HTTP/2 gRPC stream: encode_spans": _best_us(
            lambda: encode_spans(h2, opts, enricher.new_id), n
        ),
        **on_writers(h2, (("HTTP/2 gRPC stream: Python encoder, compiled join", "join"),)),
        "OTLP request of encoded spans (OTLP destinations)": _best_us(
            lambda: encode_request_bytes(encoded_batch), reps, BATCH
        ),
    }
    file_path = ("decode", "Enricher", "build_spans", "Metrics", "OTLP-JSON")
    in_file_path = [k for k in stages if k.startswith(file_path)]
    otlp_path = ("decode", "Enricher", "encode_spans", "Metrics", "OTLP request of")
    if BatchWriter.available():
        # what `tracejoin run` does with this (common) record: decode, enrich and encode_spans
        # in the batch writer's one call a batch
        writer, raws = BatchWriter(enricher, opts), [raw] * BATCH
        assert writer.write(raws, []) == [], "the sample record is not the common case"
        stages[BATCH_ROW] = _best_us(lambda: writer.write(raws, []), reps, BATCH)
        otlp_path = (BATCH_ROW, "Metrics", "OTLP request of")
    in_otlp_path = [k for k in stages if k.startswith(otlp_path)]
    return {
        "join": "compiled server span" if span_bytes.COMPILED else "pure-Python",
        "spans_per_record": len(spans),
        "server_span_attributes": len(spans[0].attributes),
        "us_per_record": {k: round(v, 2) for k, v in stages.items()},
        "sum_file_destination_us": round(sum(stages[k] for k in in_file_path), 1),
        "sum_otlp_destination_us": round(sum(stages[k] for k in in_otlp_path), 1),
    }


def format_table(res: dict[str, Any]) -> str:
    lines = [
        f"one record -> {res['spans_per_record']} spans ({res['server_span_attributes']} "
        # results from before the compiled join have no "join": theirs was the Python one
        f"attributes on the server span); join: {res.get('join', 'pure-Python')}; "
        "CPU µs per record, best of 3:"
    ]
    for k, v in res["us_per_record"].items():
        lines.append(f"  {k:<50} {v:>8.2f}")
    lines.append(
        f"  {'sum on the path bench/run.py measures (file)':<50} "
        f"{res['sum_file_destination_us']:>8.1f}"
    )
    if "sum_otlp_destination_us" in res:  # results from before the object-free path lack it
        lines.append(
            f"  {'sum on the OTLP-only path (tracejoin run, no objects)':<50} "
            f"{res['sum_otlp_destination_us']:>8.1f}"
        )
    return "\n".join(lines)


def save_records(path: Path, records: list[bytes]) -> None:
    """Raw ring-buffer records, each as a 4-byte little-endian length and its bytes."""
    with open(path, "wb") as f:
        for r in records:
            f.write(len(r).to_bytes(4, "little") + r)


def load_records(path: Path) -> list[bytes]:
    data, out, at = path.read_bytes(), [], 0
    while at + 4 <= len(data):
        n = int.from_bytes(data[at : at + 4], "little")
        out.append(data[at + 4 : at + 4 + n])
        at += 4 + n
    return out


REPLAY_BATCH = 100  # records a batch-writer call in the replay (a wake-up at 1k req/s)


def replay(records: list[bytes], opts: SpanOptions | None = None) -> dict[str, float]:
    """decode, enrich and encode_spans over recorded live records, each stage over all of them
    in turn, best of 5: CPU µs per record; then the batch writer over the same records (the
    stages' sum is what it replaces for those it writes). The same records every run, so a
    change to a stage can be measured without the live agent's noise (the load generator shares
    its CPU)."""
    metrics = Metrics()
    decoder = RecordDecoder(metrics)
    resource = Resource((("service.name", "bench"), ("process.executable.name", "goserver")))
    enricher = Enricher(metrics, lambda _pid: resource)
    if opts is None:  # the live agent's signals on this host: the work set too
        base = agent_span_options()
        opts = dataclasses.replace(base, signals=base.signals | {"workset"})
    decoded = [r for r in map(decoder.decode, records) if isinstance(r, HttpRecord)]
    enriched = [e for e in map(enricher.enrich, decoded) if e is not None]

    def best(fn: Callable[[], object], n: int) -> float:
        times = []
        for _ in range(5):
            t0 = time.process_time()
            fn()
            times.append(time.process_time() - t0)
        return min(times) * 1e6 / max(1, n)

    new_id = enricher.new_id
    stages = {
        "decode": best(lambda: [decoder.decode(r) for r in records], len(records)),
        "Enricher.enrich": best(lambda: [enricher.enrich(r) for r in decoded], len(decoded)),
        "encode_spans": best(
            lambda: [encode_spans(e, opts, new_id) for e in enriched], len(enriched)
        ),
    }
    spans = sum(len(encode_spans(e, opts, new_id)) for e in enriched)
    stages["sum"] = sum(stages.values())
    if BatchWriter.available():  # the three in one C call for the common record (compiled)
        writer = BatchWriter(enricher, opts)
        batches = [records[i : i + REPLAY_BATCH] for i in range(0, len(records), REPLAY_BATCH)]
        left: list[bytes] = []

        def write_all() -> None:
            left.clear()
            for b in batches:
                left.extend(writer.write(b, []))

        stages[f"batch writer ({REPLAY_BATCH} a call)"] = best(write_all, len(records))
        stages["  records it left"] = float(len(left))
    stages["spans per record"] = spans / max(1, len(enriched))
    return stages


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--records",
        type=Path,
        help="replay live records saved by `bench.profile_agent --save-records PATH` through "
        "decode, enrich and encode_spans instead of timing the synthetic one",
    )
    ap.add_argument(
        "--encoder",
        choices=span_bytes.ENCODERS,
        default="compiled",
        help="with --records: the server span's writer (compiled as installed; the Python encoder "
        "on the compiled join; pure Python)",
    )
    args = ap.parse_args(argv)
    if args.records:
        try:
            span_bytes.use_encoder(args.encoder)
        except RuntimeError as exc:
            print(f"bench.stages: {exc}", file=sys.stderr)
            return 2
        records = load_records(args.records)
        if not records:
            print(f"bench.stages: no records in {args.records}", file=sys.stderr)
            return 2
        res = replay(records)
        print(
            f"{len(records):,} live records from {args.records}, encoder {args.encoder}; "
            "CPU µs per record, best of 5:"
        )
        for k, v in res.items():
            print(f"  {k:<28} {v:>8.2f}")
        return 0
    print(format_table(run()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
