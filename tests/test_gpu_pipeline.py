"""Issue 5 through the real pipeline: real BPF and a real server; NVML replaced at its boundary
by tests/nvml_fake.py (no GPU on these machines; bench/gpu_check.py checks the real thing)."""

from __future__ import annotations

import pytest
from harness import free_ports, new_traceparent, raw_request, server
from nvml_fake import FakeDevice, FakeNvml
from tracejoin.app import build_agent
from tracejoin.config import Settings
from tracejoin.core.metrics import Metrics
from tracejoin.core.model import KIND_SERVER
from tracejoin.enrich.gpu_sampler import GpuSampler
from tracejoin.exporters.base import InMemoryExporter
from tracejoin.exporters.queue import BatchExportQueue

pytestmark = pytest.mark.privileged


def test_spans_carry_the_gpu_window_of_their_process(require_root):
    """The motivating incident: kernel-active 12%, memory controller 94% busy: the span says so,
    under names that say what NVML measured."""
    (port,) = free_ports(1)
    dev = FakeDevice(0, uuid="GPU-11111111-2222-3333-4444-555555555555")
    dev.util_gpu, dev.util_memory = 12, 94
    sampler = GpuSampler(Metrics(), nvml=FakeNvml([dev]), interval_s=0.05)
    metrics = Metrics()
    memory = InMemoryExporter()
    queue = BatchExportQueue(memory, metrics, flush_interval_s=0.05, name="memory")
    agent = build_agent(
        Settings(port=(port,), gpu_sample_hz=1.5), metrics, [queue], gpu_sampler=sampler
    )
    with server("threaded", port) as proc:
        dev.compute_procs = {proc.pid: 3 << 30}
        agent.start()
        assert agent.gpu is sampler, agent.gpu_text
        try:
            tp, trace_id, _ = new_traceparent()
            raw_request(
                port,
                f"GET /infer HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\n"
                "Connection: close\r\n\r\n".encode(),
            )
            import time

            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not [
                s for s in memory.spans if s.trace_id == trace_id
            ]:
                time.sleep(0.05)
        finally:
            agent.shutdown(5.0)
    (span,) = [s for s in memory.spans if s.trace_id == trace_id and s.kind == KIND_SERVER]
    a = span.attributes
    assert a["tracejoin.gpu.kernel_active.ratio.avg"] == pytest.approx(0.12, abs=0.01)
    assert a["tracejoin.gpu.memory_controller_busy.ratio.max"] == pytest.approx(0.94, abs=0.01)
    assert a["tracejoin.gpu.device.uuid"] == dev.uuid
    assert a["tracejoin.gpu.process.memory.used.max"] == 3 << 30
    # NVML's ambiguous "utilization" never names a device-level attribute (docs/gpu.md)
    assert not [k for k in a if "utilization" in k], sorted(a)


def test_the_gpu_window_reaches_jaeger_on_the_batch_writers_path(require_root, jaeger):
    """`tracejoin run` on a GPU node, as deployed: OTLP only, so the common request's spans are
    the batch writer's, held until the samples cover them. The span in Jaeger, in the caller's
    trace, carries its process's GPU window; the stages never saw the request."""
    import dataclasses

    from jaeger import span_tags, the_server_span
    from tracejoin.exporters.http_sender import OtlpHttpExporter
    from tracejoin.pipeline.spans import needs_children

    (port,) = free_ports(1)
    dev = FakeDevice(0, uuid="GPU-66666666-7777-8888-9999-000000000000")
    dev.util_gpu, dev.util_memory = 37, 81
    sampler = GpuSampler(Metrics(), nvml=FakeNvml([dev]), interval_s=0.05)
    metrics = Metrics()
    otlp = BatchExportQueue(
        OtlpHttpExporter(jaeger.otlp_http_traces_url), metrics, flush_interval_s=0.1, name="otlp"
    )
    agent = build_agent(
        Settings(port=(port,), gpu_sample_hz=1.5, service_name="tj-gpu-batch"),
        metrics,
        [otlp],
        gpu_sampler=sampler,
    )
    with server("threaded", port) as proc:
        dev.compute_procs = {proc.pid: 2 << 30}
        agent.start()
        try:
            assert agent.pipeline is not None and agent.pipeline.batch_writer is not None
            staged: list[object] = []
            enrich = agent.pipeline.enricher.enrich
            agent.pipeline.enricher.enrich = lambda rec: staged.append(rec) or enrich(rec)  # type: ignore[method-assign]
            tp, trace_id, parent = new_traceparent()
            raw_request(
                port,
                f"GET /infer HTTP/1.1\r\nHost: t\r\ntraceparent: {tp}\r\n"
                "Connection: close\r\n\r\n".encode(),
            )
            trace = jaeger.get_trace(f"{trace_id:032x}", timeout_s=20)
            opts = agent.pipeline.span_options
        finally:
            agent.shutdown(5.0)
    tags = span_tags(the_server_span(trace, trace_id, parent))
    assert tags["tracejoin.gpu.kernel_active.ratio.avg"] == pytest.approx(0.37, abs=0.01)
    assert tags["tracejoin.gpu.memory_controller_busy.ratio.max"] == pytest.approx(0.81, abs=0.01)
    assert tags["tracejoin.gpu.device.uuid"] == dev.uuid
    others = dataclasses.replace(opts, signals=opts.signals - {"workset"})
    for rec in staged:  # only a child span the writer leaves sends a request to the stages
        assert needs_children(rec, others), rec
