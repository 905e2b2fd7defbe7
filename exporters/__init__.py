"""Span exporters: OTLP protobuf/JSON encoders, senders (gRPC, HTTP, JSON-lines file, console),
environment configuration and the batching export queue.

Modules, by what they hold:
  base        SpanExporter protocol, ExportResult, InMemoryExporter (test double)
  otlp_proto  model.Span -> OTLP protobuf wire bytes (the hot path)
  otlp_json   model.Span -> OTLP/JSON, and OTLP/JSON -> protobuf
  grpc_sender, http_sender, file_sender   the network and file senders
  config      OTEL_EXPORTER_OTLP_* -> a sender
  queue       BatchExportQueue (batching, retries, loss counting) and FanoutQueue
"""

from tracejoin.exporters.base import ExportResult, ExportStatus, InMemoryExporter, SpanExporter

__all__ = ["ExportResult", "ExportStatus", "InMemoryExporter", "SpanExporter"]
