"""Span exporters: OTLP protobuf/JSON encoders, senders (gRPC, HTTP, JSON-lines file, console,
Perfetto), environment configuration and the batching export queue.

Modules, by what they hold:
  base        SpanExporter protocol, ExportResult, InMemoryExporter (test double)
  otlp_proto  model.Span -> OTLP protobuf wire bytes (the hot path)
  otlp_json   model.Span -> OTLP/JSON, and OTLP/JSON -> protobuf
  grpc_sender, http_sender   the opentelemetry-exporter-otlp exporters, fed otlp_proto's bytes,
              one attempt per call
  file_sender the OTLP/JSON-lines file and the console
  perfetto    Chrome trace-event JSON (ui.perfetto.dev) from spans and GPU histories
  config      OTEL_EXPORTER_OTLP_* and overrides -> a sender
  queue       BatchExportQueue (batching, retries, loss counting) and FanoutQueue

Imports only the ground floor (tracejoin.core) of the agent.
"""

from tracejoin.exporters.base import ExportResult, ExportStatus, InMemoryExporter, SpanExporter

__all__ = ["ExportResult", "ExportStatus", "InMemoryExporter", "SpanExporter"]
