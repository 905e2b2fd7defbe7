"""The composition root: the one place that builds the agent from settings.

`build_agent` wires the record source (the BPF probes unless one is injected), the enrichers,
the pipeline and the destinations chosen here. `Agent` gives them one lifecycle: start() brings
them up sink-first (destinations, GPU sampler, then the probes, then the reader), and the
idempotent shutdown(timeout_s) takes them down source-first under one deadline (detach the
probes, drain what the kernel already queued, flush, close). `tracejoin capture` and
`tracejoin run` are thin front-ends over this.
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import psutil
from tracejoin.config import ConfigError, Settings
from tracejoin.core.metrics import AGG_BUCKET_BOUNDS, AGGREGATED_WHY, Metrics
from tracejoin.core.model import AttrValue
from tracejoin.enrich.enricher import Enricher
from tracejoin.enrich.inspector import ProcessInspector
from tracejoin.enrich.k8s import KubeletClient, expand_node_name
from tracejoin.enrich.resources import (
    ResourceResolver,
    env_resource_attributes,
    parse_instrumented_services,
)
from tracejoin.host.scheduling import request_slice
from tracejoin.kernel.probes import OPTIONAL_TRACEPOINTS, HttpProbes, ProbeConfig, ProbeStatus
from tracejoin.pipeline.budget import BudgetController
from tracejoin.pipeline.spans import SpanOptions
from tracejoin.pipeline.stages import (
    Destination,
    GpuHold,
    Observer,
    Pipeline,
    RecordSource,
    flush_in_parallel,
)

log = logging.getLogger("tracejoin")

DEFAULT_SPANS_FILE = Path("tracejoin-spans.otlp.jsonl")


# ----------------------------------------------------------------------------- settings -> parts


def probe_config(s: Settings, *, http2_after_ready: bool = False) -> ProbeConfig:
    unknown = [tp for tp in s.disable_tracepoint if tp not in OPTIONAL_TRACEPOINTS]
    if unknown:
        raise ConfigError(
            f"--disable-tracepoint: {', '.join(unknown)} is not an optional tracepoint "
            f"(choose from {', '.join(OPTIONAL_TRACEPOINTS)})"
        )
    return ProbeConfig(
        pids=s.pid,
        ports=s.port,
        comm=s.comm,
        otlp_ports=s.otlp_ports if s.instrumented == "auto" else (),
        runq_threshold_ns=int(s.runq_threshold_ms * 1e6),
        disabled_tracepoints=frozenset(s.disable_tracepoint),
        tlb_hardware={"auto": None, "hardware": True, "flush": False}[s.tlb],
        cuda=s.cuda,
        cuda_launches=s.cuda_launches,
        cuda_sync_threshold_ns=int(s.cuda_sync_threshold_ms * 1e6),
        http2_after_ready=http2_after_ready,
        bpf_cache_dir=Path(s.bpf_cache) if s.bpf_cache else None,
    )


def otlp_destination(
    s: Settings, metrics: Metrics, environ: Mapping[str, str] | None = None
) -> Destination | None:
    """An OTLP queue when an endpoint is configured (flag or OTEL_* variables)."""
    from tracejoin.exporters.config import exporter_from_env
    from tracejoin.exporters.queue import BatchExportQueue

    env = os.environ if environ is None else environ
    if not (
        s.otlp_endpoint
        or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        return None
    # the flag wins over the OTEL_* variables; errors name the flag's key
    overrides = {"endpoint": s.otlp_endpoint, "protocol": s.otlp_protocol}
    if s.otlp_endpoint:
        overrides["traces_endpoint"] = None
    try:
        exporter = exporter_from_env(env, overrides)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    return BatchExportQueue(
        exporter,
        metrics,
        max_queue_spans=s.queue_size,
        name="otlp",
        flush_interval_s=s.export_interval,
    )


def file_destination(path: Path, s: Settings, metrics: Metrics) -> Destination:
    from tracejoin.exporters.file_sender import JsonLinesFileExporter
    from tracejoin.exporters.queue import BatchExportQueue

    return BatchExportQueue(
        JsonLinesFileExporter(path),
        metrics,
        max_queue_spans=s.queue_size,
        name="file",
        flush_interval_s=0.5,
    )


def run_destinations(s: Settings, metrics: Metrics, spans_file: Path | None) -> list[Destination]:
    """`tracejoin run`: OTLP when configured; the spans file when asked for, or when there is
    nowhere else to send."""
    out: list[Destination] = []
    otlp = otlp_destination(s, metrics)
    if otlp is not None:
        out.append(otlp)
    if spans_file is not None or otlp is None:
        out.append(file_destination(spans_file or DEFAULT_SPANS_FILE, s, metrics))
    return out


def capture_destinations(
    s: Settings, metrics: Metrics, spans_path: Path, perfetto: Any
) -> list[Destination]:
    """`tracejoin capture`: the spans file and the Perfetto timeline, plus OTLP when set."""
    from tracejoin.exporters.queue import BatchExportQueue

    out: list[Destination] = [
        file_destination(spans_path, s, metrics),
        BatchExportQueue(
            perfetto, metrics, max_queue_spans=s.queue_size, name="perfetto", flush_interval_s=0.5
        ),
    ]
    otlp = otlp_destination(s, metrics)
    if otlp is not None:
        out.append(otlp)
    return out


def open_gpu(s: Settings, metrics: Metrics, sampler: Any = None) -> tuple[Any, str]:
    """(the started NVML sampler, or None; how the GPU signal is described to the user).
    `sampler`: one to use instead of opening NVML (tests pass one over an NVML double)."""
    if sampler is None:
        if not s.gpu:
            metrics.set("gpu_sampler_running", 0)
            metrics.set("gpu_nvml_available", 0)
            return None, "off (--no-gpu)"
        from tracejoin.enrich.gpu_sampler import GpuSampler

        sampler = GpuSampler(metrics, interval_s=1.0 / s.gpu_sample_hz)
    status = sampler.start()
    if not status.available:
        log.info("GPU signal off: %s", status.reason)
        sampler.shutdown()
        metrics.set("gpu_sampler_running", 0)
        return None, f"off ({status.reason})"
    n = len(sampler.histories())
    return sampler, f"{n} device{'s' if n != 1 else ''} sampled"


def kubelet_client(s: Settings) -> KubeletClient | None:
    """The kubelet client --kubelet-url asks for; None when unset. ConfigError names the flag."""
    if not s.kubelet_url:
        return None
    try:
        url = expand_node_name(s.kubelet_url, s.node_name)
    except ValueError as exc:
        raise ConfigError(f"kubelet_url (--kubelet-url): {exc}") from exc
    log.info("pod metadata from the kubelet at %s", url)
    return KubeletClient(
        url,
        token_file=s.kubelet_token_file,
        ca_file=s.kubelet_ca_file,
        insecure_tls=s.kubelet_insecure_tls,
    )


# ----------------------------------------------------------------------------- the agent


class Agent:
    """Destinations, GPU sampler, resources, record source and pipeline, with one lifecycle.
    start() may raise (ProbeError when the probes cannot load); shutdown() always cleans up
    whatever start() got to, and is idempotent and safe without start."""

    def __init__(
        self,
        s: Settings,
        metrics: Metrics,
        source: RecordSource,
        destinations: Sequence[Destination],
        make_resources: Callable[[dict[str, AttrValue]], ResourceResolver],
        *,
        gpu_sampler: Any = None,
        observers: Sequence[Observer] = (),
    ) -> None:
        self.settings = s
        self.metrics = metrics
        self.source = source
        self.destinations = list(destinations)
        self.make_resources = make_resources
        self.observers = list(observers)
        self._given_gpu = gpu_sampler
        self.gpu: Any = None
        self.gpu_text = "off"
        self.resources: ResourceResolver | None = None
        self.pipeline: Pipeline | None = None
        self.ready = threading.Event()
        self._lock = threading.Lock()
        self._stopped = False
        self._self = psutil.Process()
        self.budget = BudgetController(s.cpu_budget)
        self._sampling_lock = threading.Lock()  # the ratio's changes reach the kernel in order

    @property
    def status(self) -> ProbeStatus:
        return self.source.status

    def start(self) -> None:
        s = self.settings
        # First, so that every thread and compile child started from here inherits it.
        cpu_slice = request_slice(s.cpu_slice_ms)
        log.info("scheduler: %s", cpu_slice.describe())
        if cpu_slice.honoured:
            self.metrics.set("cpu_slice_seconds", cpu_slice.granted_ns / 1e9)
        for dest in self.destinations:
            dest.start()
        self.gpu, self.gpu_text = open_gpu(s, self.metrics, self._given_gpu)
        self.source.start()  # loads (a child compiles first if not cached), attaches: seconds
        status = self.source.status
        with self._lock:
            if self._stopped:  # shut down while the probes loaded: leave it to shutdown()
                return
            self.resources = self.make_resources({"tracejoin.tlb.mode": status.tlb_mode})
            self.resources.start()
            enricher = Enricher(
                self.metrics,
                self.resources.served,
                no_parent=s.no_parent,
                unsampled=s.unsampled,
            )
            options = SpanOptions.from_status(
                status.signals,
                status.tlb_mode,
                int(s.runq_threshold_ms * 1e6),
                int(s.recvq_threshold_ms * 1e6),
            )
            gpu_hold = (
                GpuHold(self.gpu, self.metrics, hold_s=3.0 / s.gpu_sample_hz)
                if self.gpu is not None
                else None
            )
            self.pipeline = Pipeline(
                self.source,
                enricher,
                options,
                self.destinations,
                self.metrics,
                gpu_hold=gpu_hold,
                observers=self.observers,
                on_fill=self._budget_fill,
            )
            self.pipeline.start()
            set_policy = getattr(self.source, "set_policy", None)
            if set_policy is not None:  # from now on the kernel keeps what makes no span
                set_policy(unsampled=s.unsampled, no_parent=s.no_parent)
        self.ready.set()

    def alive(self) -> bool:
        """The reader runs (true before start, when nothing is expected to run yet)."""
        return self.pipeline is None or self.pipeline.reader_alive()

    def refresh_metrics(self) -> None:
        """Copy in what is kept elsewhere as running totals: the kernel's counters, and the
        agent's own CPU time and resident memory, so /metrics and the capture's counters show
        what the agent itself costs (a scrape; the capture's summary)."""
        cpu_s = time.process_time()  # every thread's, to the ns (the budget's reading too)
        self.metrics.set("process_cpu_seconds", cpu_s)
        self.metrics.set("process_resident_memory_bytes", self._self.memory_info().rss)
        if self.pipeline is not None:
            counters = self.pipeline.kernel_counters()
            self._apply_budget(cpu_s, counters.get("ringbuf_full", 0))
            self._copy_shed()
            self._copy_aggregates()

    def tick(self) -> None:
        """`tracejoin run`'s once a second: the overload budget's step, from the agent's CPU
        and the ring's losses, when there is a budget. Everything else /metrics shows is copied
        in when it is scraped (refresh_metrics): an idle agent spent half a millisecond a
        second copying it for no one."""
        if self.pipeline is None or self.budget.budget <= 0:
            return
        counters = self.pipeline.kernel_counters()
        self._apply_budget(time.process_time(), counters.get("ringbuf_full", 0))

    def _copy_aggregates(self) -> None:
        """The kernel's per-endpoint aggregates of requests no span is made of (the policies
        --unsampled follow, --no-parent skip): counts, summed latency, latency buckets."""
        aggregates = getattr(self.source, "aggregates", None)
        if aggregates is None:
            return
        for why, endpoints in aggregates().items():
            if why not in AGGREGATED_WHY:
                continue  # the budget's own: requests_sampled_out (_apply_budget)
            by_port: dict[int, tuple[int, int, list[int]]] = {}
            for (_pid, port), (count, sum_ns, hist) in endpoints.items():
                n, ns, h = by_port.get(port, (0, 0, [0] * len(hist)))
                by_port[port] = (
                    n + count,
                    ns + sum_ns,
                    [a + b for a, b in zip(h, hist, strict=True)],
                )
            for port, (count, sum_ns, hist) in by_port.items():
                labels = {"port": str(port), "why": why}
                self.metrics.set("requests_aggregated", count, **labels)
                self.metrics.set("requests_aggregated_seconds", sum_ns / 1e9, **labels)
                running = 0
                for le, n in zip(AGG_BUCKET_BOUNDS, hist, strict=True):
                    running += n
                    self.metrics.set("requests_aggregated_latency_bucket", running, le=le, **labels)

    def _budget_fill(self, fraction: float) -> None:
        """The reader's batch filled `fraction` of the ring (on the reader thread)."""
        with self._sampling_lock:
            before = self.budget.ratio
            ratio = self.budget.filled(time.monotonic(), fraction)
            why = "the reader behind: a batch took %.0f%% of the ring"
            self._set_sampling(before, ratio, why, fraction * 100)

    def _set_sampling(self, before: float, ratio: float, why: str, value: float) -> None:
        """Hand a changed ratio to the kernel and log why (`why` % value: formatted only then,
        since the reader calls this for every batch)."""
        set_sampling = getattr(self.source, "set_sampling", None)
        if ratio != before and set_sampling is not None:
            set_sampling(ratio)
            log.info(
                "cpu budget %.2f: " + why + "; sampling ratio %.4g -> %.4g",
                self.budget.budget,
                value,
                before,
                ratio,
            )

    def _apply_budget(self, cpu_s: float, ringbuf_full: int) -> None:
        """One step of the overload budget: the ratio for the kernel, and what it shed."""
        with self._sampling_lock:
            before = ratio = self.budget.ratio
            if getattr(self.source, "loading", False):
                self.budget.skip()  # verifying HTTP/2's programs after ready: not load to shed
            else:
                ratio = self.budget.update(time.monotonic(), cpu_s, ringbuf_full)
            self._set_sampling(before, ratio, "agent at %.2f of a CPU", self.budget.share)
        self.metrics.set("sampling_ratio", ratio)
        self.metrics.set("agent_cpu_share", round(self.budget.share, 4))

    def _copy_shed(self) -> None:
        """What the budget sampled out, per port (the kernel's shed map)."""
        shed = getattr(self.source, "shed", None)
        if shed is None:
            return
        by_port: dict[int, list[float]] = {}
        for (_pid, port), (count, sum_ns, _hist) in shed().items():
            acc = by_port.setdefault(port, [0, 0.0])
            acc[0] += count
            acc[1] += sum_ns / 1e9
        for port, (count, seconds) in by_port.items():
            self.metrics.set("requests_sampled_out", count, port=str(port))
            self.metrics.set("requests_sampled_out_seconds", seconds, port=str(port))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Source-first under one deadline: detach, drain, flush, close. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            pipeline = self.pipeline
        deadline = time.monotonic() + timeout_s
        if pipeline is not None:
            pipeline.shutdown(max(0.1, deadline - time.monotonic()))
        else:  # start() failed or never ran: close what it opened
            self.source.shutdown()
            flush_in_parallel(self.destinations, deadline)
        if self.gpu is not None:
            stopper = threading.Thread(
                target=self.gpu.shutdown, daemon=True, name="tracejoin-gpu-stop"
            )
            stopper.start()
            stopper.join(max(0.1, deadline - time.monotonic()))
        if self.resources is not None:
            self.resources.shutdown(max(0.1, deadline - time.monotonic()))


def settle_gc() -> None:
    """After start-up: move everything start-up made (modules, BCC's tables, caches) out of the
    collector's sight, and collect the young generation every 50k allocations instead of 700.
    Each record allocates several short-lived objects that reference counting frees; with the
    default threshold the collector ran every few records and re-walked start-up's objects."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def build_agent(
    s: Settings,
    metrics: Metrics,
    destinations: Sequence[Destination],
    *,
    source: RecordSource | None = None,
    gpu_sampler: Any = None,
    observers: Sequence[Observer] = (),
    http2_after_ready: bool = False,
) -> Agent:
    """Everything that can be checked before the probes load is checked here (ConfigError).
    http2_after_ready: `tracejoin run` is ready before the HTTP/2 programs are verified."""
    try:
        env_resource_attributes()  # a bad OTEL_RESOURCE_ATTRIBUTES fails now, naming it
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    kubelet = kubelet_client(s)
    try:
        instrumented_services = parse_instrumented_services(s.instrumented_services)
    except ValueError as exc:
        raise ConfigError(f"--instrumented-services: {exc}") from exc

    if source is None:
        source = HttpProbes(probe_config(s, http2_after_ready=http2_after_ready), metrics)
    # the kernel counts connections to an OTLP port: the inspector's cue to look again
    otlp_connects: Callable[[], int | None] | None = (
        partial(source.kernel_counter, "otlp_connects") if isinstance(source, HttpProbes) else None
    )

    def make_resources(static: dict[str, AttrValue]) -> ResourceResolver:
        # built once the probes say what the static attributes are (the TLB mode)
        return ResourceResolver(
            metrics,
            service_name=s.service_name,
            static=static,
            kubelet=kubelet,
            node_name=s.node_name,
            inspector=ProcessInspector(
                metrics,
                read_environ=s.read_environ,
                check_otlp=s.instrumented == "auto",
                otlp_ports=s.otlp_ports,
                otlp_connects=otlp_connects,
            ),
            instrumented=s.instrumented,
            instrumented_services=instrumented_services,
        )

    return Agent(
        s,
        metrics,
        source,
        destinations,
        make_resources,
        gpu_sampler=gpu_sampler,
        observers=observers,
    )
