"""Export encoding throughput: tracejoin's encoder against the OpenTelemetry SDK, same run.

Both paths start from the same raw per-request values (ids, times, 20 attributes like an HTTP
server span with kernel enrichment, 2 events) and end with serialized OTLP protobuf bytes:

  tracejoin   model.Span -> otlp_proto.encode_request_bytes (what the senders send);
              also shown: + parse into a message and SerializeToString, and the cost with the
              model.Span construction included (the fair end-to-end comparison with the SDK)
  sdk         Tracer.start_span(explicit remote parent, attributes) + 2 add_event + end ->
              BatchSpanProcessor -> encode_spans (the SDK's OTLP encoder) -> SerializeToString,
              in an exporter that encodes but does not send
  sdk_encoder model.Span -> ReadableSpan (built directly, no tracer or processor) ->
              encode_spans -> SerializePartialToString: what OTLPSpanExporter.export() does with
              a batch, i.e. the cost of using the OTLP package's own encoder from model.Span

The headline (`ratio`) is the builder's own path against the SDK, with spans shaped exactly like
the span builder's (its attribute names and counts, its child spans):

  tracejoin_build_and_encode  EnrichedRecord -> pipeline.spans.build_spans -> encode_request_bytes
  tracejoin_encoded_path      EnrichedRecord -> pipeline.span_bytes.encode_spans (the server span
                              straight to bytes, no Span object) -> encode_request_bytes: what
                              `tracejoin run` does when every destination is OTLP
  sdk                         the same spans (names, kinds, parents, attributes) started and ended
                              through the SDK's tracer, processor and encoder

The synthetic-request paths above stay as a breakdown (encode alone, the SDK's encoder alone).

Rates are spans per CPU-second (time.process_time, all threads of this process: the SDK's
batch worker included), best of `repeat` rounds. Compare the ratio, not the absolute numbers.

    python -m bench.export_throughput [--spans N] [--repeat R] [--json PATH]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource as SdkResource
from opentelemetry.sdk.trace import Event as SdkEvent
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.status import Status, StatusCode
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import (
    KIND_SERVER,
    STATUS_ERROR,
    STATUS_UNSET,
    AttrValue,
    EncodedSpan,
    Event,
    Resource,
    Span,
)
from tracejoin.enrich.enricher import EnrichedRecord, Enricher
from tracejoin.exporters.otlp_proto import encode_request, encode_request_bytes
from tracejoin.kernel.decode import HttpRecord, RecordDecoder
from tracejoin.pipeline import span_bytes
from tracejoin.pipeline.spans import SpanOptions, build_spans

from bench.stages import agent_span_options, sample_record

BATCH = 512  # the queue's default max_batch, and the SDK processor's default batch size
RESOURCE_ATTRS: tuple[tuple[str, AttrValue], ...] = (
    ("service.name", "checkout"),
    ("process.pid", 4242),
    ("process.executable.name", "gunicorn"),
    ("host.name", "gpu-node-07"),
    ("k8s.namespace.name", "shop"),
    ("k8s.pod.name", "checkout-7d9f8b6c5-x2x4q"),
)
ROUTES = ["/api/cart/{id}", "/api/items/{id}", "/api/checkout", "/healthz", "/api/search"]


@dataclass(slots=True)
class Request:
    """Raw per-request values, as the span stage has them before building any span object."""

    trace_id: int
    span_id: int
    parent_id: int
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, AttrValue]
    events: list[tuple[str, int, dict[str, AttrValue]]]
    error: bool
    kind: int = KIND_SERVER


def make_requests(n: int, seed: int = 1) -> list[Request]:
    rng = random.Random(seed)
    t0 = time.time_ns()
    out = []
    for i in range(n):
        route = rng.choice(ROUTES)
        path = route.replace("{id}", str(rng.randrange(10_000)))
        method = "POST" if route == "/api/checkout" else "GET"
        start = t0 + i * 1_000_000
        dur = rng.randrange(200_000, 50_000_000)
        status = 500 if rng.random() < 0.02 else 200
        attrs: dict[str, AttrValue] = {
            "http.request.method": method,
            "url.path": path,
            "http.route": route,
            "url.scheme": "http",
            "http.response.status_code": status,
            "network.protocol.version": "1.1",
            "server.address": "10.0.3.17",
            "server.port": 8080,
            "client.address": f"10.0.7.{rng.randrange(2, 250)}",
            "client.port": rng.randrange(32768, 61000),
            "thread.id": 4242 + rng.randrange(16),
            "tracejoin.kernel.recv_wait_ns": rng.randrange(1_000, 5_000_000),
            "tracejoin.kernel.on_cpu_ns": rng.randrange(50_000, dur),
            "tracejoin.kernel.runq_wait_ns": rng.randrange(0, 2_000_000),
            "tracejoin.kernel.page_faults.minor": rng.randrange(0, 400),
            "tracejoin.kernel.ctx_switches.involuntary": rng.randrange(0, 20),
            "tracejoin.kernel.bytes_received": rng.randrange(200, 4_000),
            "tracejoin.kernel.bytes_sent": rng.randrange(200, 400_000),
            "tracejoin.gpu.busy_fraction_window": round(rng.random(), 4),
            "tracejoin.traceparent.sampled": True,
        }
        events: list[tuple[str, int, dict[str, AttrValue]]] = [
            ("tracejoin.first_read", start + 40_000, {"tracejoin.backlog_wait_ns": 38_500}),
            ("tracejoin.first_write", start + dur - 90_000, {}),
        ]
        out.append(
            Request(
                trace_id=rng.getrandbits(128) | 1,
                span_id=rng.getrandbits(64) | 1,
                parent_id=rng.getrandbits(64) | 1,
                name=f"{method} {route}",
                start_ns=start,
                end_ns=start + dur,
                attributes=attrs,
                events=events,
                error=status >= 500,
            )
        )
    return out


Built = tuple[list[EnrichedRecord], SpanOptions, Callable[[int], int]]


def builder_records(n: int, seed: int = 2) -> Built:
    """n enriched records as the span stage gets them (bench.stages' record, with varied ids,
    paths, sizes and times), with the options and id source the builder uses."""
    rng = random.Random(seed)
    metrics = Metrics()
    resource = Resource(RESOURCE_ATTRS)
    enricher = Enricher(metrics, lambda _pid: resource)
    decoder = RecordDecoder(metrics)
    base = HttpRecord.from_buffer_copy(sample_record())
    out = []
    for _ in range(n):
        r = HttpRecord.from_buffer_copy(bytes(base))
        tp = f"00-{rng.getrandbits(128) | 1:032x}-{rng.getrandbits(64) | 1:016x}-01".encode()
        r.tp, r.tp_len = tp, len(tp)
        path = rng.choice(ROUTES).replace("{id}", str(rng.randrange(10_000))).encode()
        r.path, r.path_len = path, len(path)
        r.req_bytes, r.resp_bytes = rng.randrange(200, 4_000), rng.randrange(200, 400_000)
        r.rport = rng.randrange(32768, 61000)
        r.nr_switches, r.minflt = rng.randrange(0, 20), rng.randrange(0, 400)
        r.runq_ns, r.offcpu_ns = rng.randrange(0, 2_000_000), rng.randrange(0, 5_000_000)
        rec = decoder.decode(bytes(r))
        assert isinstance(rec, HttpRecord)
        e = enricher.enrich(rec)
        assert e is not None
        out.append(e)
    return out, agent_span_options(), enricher.new_id


def builder_build_and_encode(
    records: Sequence[EnrichedRecord], opts: SpanOptions, new_id: Callable[[int], int]
) -> int:
    """What the reader and an OTLP destination do per batch: build every record's spans, then
    encode them; returns bytes produced."""
    total = 0
    for i in range(0, len(records), BATCH):
        spans: list[Span] = []
        for e in records[i : i + BATCH]:
            spans += build_spans(e, opts, new_id)
        total += len(encode_request_bytes(spans))
    return total


def builder_encoded_path(
    records: Sequence[EnrichedRecord], opts: SpanOptions, new_id: Callable[[int], int]
) -> int:
    """The same through the object-free path (all destinations OTLP): returns bytes produced."""
    total = 0
    for i in range(0, len(records), BATCH):
        spans: list[Span | EncodedSpan] = []
        for e in records[i : i + BATCH]:
            spans += span_bytes.encode_spans(e, opts, new_id)
        total += len(encode_request_bytes(spans))
    return total


def requests_from_spans(spans: Sequence[Span]) -> list[Request]:
    """The builder's spans as the SDK path's input: same names, kinds, ids, times, attributes."""
    return [
        Request(
            s.trace_id,
            s.span_id,
            s.parent_span_id,
            s.name,
            s.start_ns,
            s.end_ns,
            dict(s.attributes),
            [],
            s.status_code == STATUS_ERROR,
            s.kind,
        )
        for s in spans
    ]


def to_model_spans(requests: Sequence[Request], resource: Resource) -> list[Span]:
    return [
        Span(
            r.trace_id,
            r.span_id,
            r.parent_id,
            r.name,
            KIND_SERVER,
            r.start_ns,
            r.end_ns,
            resource,
            r.attributes,
            [Event(name, t, attrs) for name, t, attrs in r.events],
            STATUS_ERROR if r.error else STATUS_UNSET,
            "HTTP 500" if r.error else "",
            1,
        )
        for r in requests
    ]


# ----------------------------------------------------------------------------- the paths


def _one(b: Built) -> tuple[EnrichedRecord, SpanOptions, Callable[[int], int]]:
    records, opts, new_id = b
    return records[0], opts, new_id


def _cpu(fn: Callable[[], int]) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, bytes produced) for one call of fn."""
    gc.collect()
    c0, w0 = time.process_time(), time.perf_counter()
    size = fn()
    return time.process_time() - c0, time.perf_counter() - w0, size


def tracejoin_encode(spans: Sequence[Span]) -> int:
    return sum(len(encode_request_bytes(spans[i : i + BATCH])) for i in range(0, len(spans), BATCH))


def tracejoin_encode_message(spans: Sequence[Span]) -> int:
    return sum(
        len(encode_request(spans[i : i + BATCH]).SerializeToString())
        for i in range(0, len(spans), BATCH)
    )


def tracejoin_build_and_encode(requests: Sequence[Request], resource: Resource) -> int:
    total = 0
    for i in range(0, len(requests), BATCH):
        total += len(encode_request_bytes(to_model_spans(requests[i : i + BATCH], resource)))
    return total


_SDK_KIND = {KIND_SERVER: SpanKind.SERVER}
_SCOPE = InstrumentationScope("tracejoin", "0")


def sdk_encoder(spans: Sequence[Span]) -> int:
    """model.Span -> ReadableSpan -> the package's encode_spans, batch by batch."""
    total = 0
    resources: dict[Resource, SdkResource] = {}
    for i in range(0, len(spans), BATCH):
        readable = []
        for s in spans[i : i + BATCH]:
            res = resources.get(s.resource)
            if res is None:
                res = resources[s.resource] = SdkResource(dict(s.resource.attributes))
            flags = TraceFlags(s.trace_flags & 0xFF)
            readable.append(
                ReadableSpan(
                    s.name,
                    context=SpanContext(s.trace_id, s.span_id, False, flags),
                    parent=SpanContext(s.trace_id, s.parent_span_id, True, flags)
                    if s.parent_span_id else None,
                    resource=res,
                    attributes=s.attributes,
                    events=[SdkEvent(e.name, e.attributes, e.time_ns) for e in s.events],
                    kind=_SDK_KIND.get(s.kind, SpanKind.INTERNAL),
                    status=Status(StatusCode(s.status_code), s.status_message or None),
                    start_time=s.start_ns,
                    end_time=s.end_ns,
                    instrumentation_scope=_SCOPE,
                )
            )  # fmt: skip
        total += len(encode_spans(readable).SerializePartialToString())
    return total


class _EncodeOnlyExporter(SpanExporter):
    """The SDK's OTLP protobuf encoding, without the network."""

    def __init__(self) -> None:
        self.spans = 0
        self.bytes = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.bytes += len(encode_spans(spans).SerializeToString())
        self.spans += len(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def sdk_path(requests: Sequence[Request]) -> Callable[[], int]:
    """A prepared SDK pipeline; the returned call creates, ends and exports every span."""
    exporter = _EncodeOnlyExporter()
    provider = TracerProvider(resource=SdkResource(dict(RESOURCE_ATTRS)))
    provider.add_span_processor(
        BatchSpanProcessor(
            exporter,
            max_queue_size=len(requests) + 1,  # never drop: every span must be encoded
            max_export_batch_size=BATCH,
            schedule_delay_millis=60_000,
        )
    )
    tracer = provider.get_tracer("tracejoin-bench", "0")

    def run() -> int:
        for r in requests:
            parent = SpanContext(r.trace_id, r.parent_id, is_remote=True,
                                 trace_flags=TraceFlags(TraceFlags.SAMPLED))  # fmt: skip
            ctx = trace.set_span_in_context(NonRecordingSpan(parent))
            span = tracer.start_span(
                r.name, context=ctx, kind=_SDK_KIND.get(r.kind, SpanKind.INTERNAL),
                attributes=r.attributes, start_time=r.start_ns,
            )  # fmt: skip
            for name, t, attrs in r.events:
                span.add_event(name, attrs, timestamp=t)
            if r.error:
                span.set_status(Status(StatusCode.ERROR, "HTTP 500"))
            span.end(end_time=r.end_ns)
        provider.force_flush(600_000)
        if exporter.spans != len(requests):
            raise RuntimeError(f"SDK exported {exporter.spans} of {len(requests)} spans")
        provider.shutdown()
        return exporter.bytes

    return run


# ------------------------------------------------------------------------------- driver


def run(n_spans: int = 10_000, repeat: int = 3) -> dict[str, Any]:
    """Measure every path `repeat` times (interleaved) and keep each one's best round."""
    requests = make_requests(n_spans)
    resource = Resource(RESOURCE_ATTRS)
    spans = to_model_spans(requests, resource)
    # the builder's own shape: as many spans as the other paths, from records
    per_record = len(build_spans(*_one(builder_records(1))))
    records, opts, new_id = builder_records(max(1, n_spans // per_record))
    built = [sp for e in records for sp in build_spans(e, opts, new_id)]
    built_requests = requests_from_spans(built)
    paths: dict[str, Callable[[], Callable[[], int]]] = {
        "tracejoin_build_and_encode": lambda: (
            lambda: builder_build_and_encode(records, opts, new_id)
        ),
        "tracejoin_encoded_path": lambda: lambda: builder_encoded_path(records, opts, new_id),
        "sdk": lambda: sdk_path(built_requests),
        "tracejoin_encode": lambda: lambda: tracejoin_encode(spans),
        "tracejoin_encode_message": lambda: lambda: tracejoin_encode_message(spans),
        "synthetic_build_and_encode": lambda: (
            lambda: tracejoin_build_and_encode(requests, resource)
        ),
        "synthetic_sdk": lambda: sdk_path(requests),
        "sdk_encoder": lambda: lambda: sdk_encoder(spans),
    }
    counts = {
        "tracejoin_build_and_encode": len(built),
        "tracejoin_encoded_path": len(built),
        "sdk": len(built),
    }
    best: dict[str, tuple[float, float, int]] = {}
    for _ in range(repeat):
        for name, prepare in paths.items():
            fn = prepare()  # set-up (providers, threads) is not timed
            cpu, wall, size = _cpu(fn)
            if name not in best or cpu < best[name][0]:
                best[name] = (cpu, wall, size)
    n_of = {name: counts.get(name, n_spans) for name in best}
    rates = {name: n_of[name] / max(cpu, 1e-9) for name, (cpu, _, _) in best.items()}
    sdk = rates["sdk"]
    return {
        "benchmark": "export_throughput",
        "n_spans": n_spans,
        "repeat": repeat,
        "batch": BATCH,
        "attributes_per_span": len(requests[0].attributes),
        "events_per_span": len(requests[0].events),
        "python": platform.python_version(),
        "paths": {
            name: {
                "spans_per_cpu_s": round(rates[name]),
                "us_per_span": round(cpu / n_of[name] * 1e6, 2),
                "cpu_s": round(cpu, 4),
                "wall_s": round(wall, 4),
                "bytes_per_span": round(size / n_of[name], 1),
                "ratio_vs_sdk": round(
                    rates[name] / (sdk if name in counts else rates["synthetic_sdk"]), 2
                ),
            }
            for name, (cpu, wall, size) in best.items()
        },
        "builder_spans_per_record": per_record,
        "builder_server_span_attributes": len(built[0].attributes),
        # the headline: the builder's spans, built and encoded, against the SDK doing the same
        "ratio": round(rates["tracejoin_build_and_encode"] / sdk, 2),
        "ratio_encoded_path": round(rates["tracejoin_encoded_path"] / sdk, 2),
        "ratio_encode_only": round(rates["tracejoin_encode"] / rates["synthetic_sdk"], 2),
        "ratio_vs_sdk_encoder": round(rates["tracejoin_encode"] / rates["sdk_encoder"], 2),
    }


def format_table(result: dict[str, Any]) -> str:
    head = f"{'path':<30} {'spans/CPU-s':>12} {'µs/span':>9} {'B/span':>8} {'× SDK':>7}"
    lines = [
        f"export throughput: {result['n_spans']} spans, {result['attributes_per_span']} attributes "
        f"+ {result['events_per_span']} events each, batches of {result['batch']}, "
        f"best of {result['repeat']}",
        head,
        "-" * len(head),
    ]
    for name, p in result["paths"].items():
        lines.append(
            f"{name:<30} {p['spans_per_cpu_s']:>12,} {p['us_per_span']:>9.1f} "
            f"{p['bytes_per_span']:>8.0f} {p['ratio_vs_sdk']:>7.2f}"
        )
    lines.append(
        f"ratio (tracejoin_build_and_encode / sdk, the span builder's spans: "
        f"{result['builder_spans_per_record']} per record, "
        f"{result['builder_server_span_attributes']} attributes on the server span): "
        f"{result['ratio']:.2f}x"
    )
    if "ratio_encoded_path" in result:  # results from before the object-free path lack it
        lines.append(
            f"ratio (tracejoin_encoded_path / sdk, the same spans, server span without objects): "
            f"{result['ratio_encoded_path']:.2f}x"
        )
    lines.append(
        f"ratio (tracejoin_encode / synthetic_sdk, encode only): {result['ratio_encode_only']:.2f}x"
    )
    lines.append(f"ratio (tracejoin_encode / sdk_encoder): {result['ratio_vs_sdk_encoder']:.2f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.export_throughput", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--spans", type=int, default=10_000, help="spans per round (default 10000)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds; the best counts (default 3)")
    ap.add_argument("--json", metavar="PATH", help="also write the result as JSON to PATH")
    args = ap.parse_args(argv)
    if args.spans < 1 or args.repeat < 1:
        ap.error("--spans and --repeat must be at least 1")
    result = run(args.spans, args.repeat)
    print(format_table(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
