"""An instrumented HTTP server, as an application with the OpenTelemetry SDK is:
`python otelserver.py PORT OTLP_HTTP_URL [--service-name NAME] [--publish-context]`.

Every request gets the app's own SERVER span (`GET <path>`, parent = the caller's traceparent),
exported over OTLP/HTTP to OTLP_HTTP_URL (a base URL; spans go to /v1/traces). Its resource is
the SDK's: OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES of the environment, or --service-name.

Before it says "ready" it exports one start-up span and flushes, so it already holds its
(keep-alive) connection to the OTLP port, as a running instrumented service does.

--publish-context publishes the SDK's resource as an OpenTelemetry process context (OTEP 4719),
as an SDK that implements it does: a memfd named OTEL_CTX mapped into the process (it shows in
/proc/<pid>/maps as `/memfd:OTEL_CTX (deleted)`), holding the 32-byte header (signature
"OTEL_CTX", version 2, payload size, publication time, payload address) followed by the
payload, a protobuf opentelemetry.proto.resource.v1.Resource. The signature is written last.
--bad-context VALUE publishes a broken one instead (signature, version or size).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import struct
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourceProto
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

HEADER = struct.Struct("=8sIIQQ")
PR_SET_VMA, PR_SET_VMA_ANON_NAME = 0x53564D41, 0
_published: list[mmap.mmap] = []  # the mapping lives as long as the process


def publish_context(resource: Resource, bad: str | None = None) -> None:
    payload = ResourceProto(
        attributes=[
            KeyValue(key=k, value=AnyValue(string_value=str(v)))
            for k, v in resource.attributes.items()
        ]
    ).SerializeToString()
    size = mmap.PAGESIZE * 2
    fd = os.memfd_create("OTEL_CTX", os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    os.close(fd)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    version, claimed = (1 if bad == "version" else 2), len(payload)
    if bad == "size":
        claimed = 1 << 30
    m[HEADER.size : HEADER.size + len(payload)] = payload
    header = HEADER.pack(b"\0" * 8, version, claimed, time.time_ns(), addr + HEADER.size)
    m[8 : HEADER.size] = header[8:]
    m[0:8] = b"OTEL_CTY" if bad == "signature" else b"OTEL_CTX"  # last
    libc = ctypes.CDLL(None, use_errno=True)
    name = ctypes.c_char_p(b"OTEL_CTX")
    # naming is optional (CONFIG_ANON_VMA_NAME); readers find the memfd by its name anyway
    libc.prctl(PR_SET_VMA, PR_SET_VMA_ANON_NAME, ctypes.c_ulong(addr), ctypes.c_ulong(size), name)
    _published.append(m)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("otlp_url")
    ap.add_argument("--service-name")
    ap.add_argument("--publish-context", action="store_true")
    ap.add_argument("--bad-context", choices=["signature", "version", "size"])
    args = ap.parse_args()

    extra = {"service.name": args.service_name} if args.service_name else {}
    provider = TracerProvider(resource=Resource.create(extra))
    exporter = OTLPSpanExporter(endpoint=args.otlp_url.rstrip("/") + "/v1/traces", timeout=10)
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=100))
    tracer = provider.get_tracer("tracejoin.tests.otelserver")
    if args.publish_context or args.bad_context:
        publish_context(provider.resource, args.bad_context)
    with tracer.start_as_current_span("startup"):
        pass
    provider.force_flush()

    propagator = TraceContextTextMapPropagator()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            ctx = propagator.extract(dict(self.headers.items()))
            with tracer.start_as_current_span(
                f"GET {self.path}",
                context=ctx,
                kind=SpanKind.SERVER,
                attributes={"http.request.method": "GET", "url.path": self.path},
            ):
                body = b"ok"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print("ready", flush=True)
    try:
        srv.serve_forever()
    finally:
        provider.shutdown()


if __name__ == "__main__":
    main()
