"""Self-metrics (tracejoin.core.metrics): one declared table, one naming convention, a typo is an
error, the exposition is prometheus_client's and carries every declared metric, and
docs/attributes.md lists exactly the table."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tracejoin.core import metrics as core_metrics
from tracejoin.core.metrics import METRICS, PREFIX, Metric, Metrics
from tracejoin.enrich import traceparent
from tracejoin.exporters.base import InMemoryExporter
from tracejoin.exporters.queue import BatchExportQueue
from tracejoin.kernel import decode, probes

ROOT = Path(__file__).resolve().parent.parent
DECLARED = {m.name: m for m in METRICS}


def served(m: Metrics) -> dict[str, tuple[str, str, dict[frozenset[tuple[str, str]], float]]]:
    """{name as served: (type, help, {labels: value})}, read back by prometheus_client."""
    out = {}
    for fam in text_string_to_metric_families(m.prometheus_text()):
        name = fam.name + ("_total" if fam.type == "counter" else "")
        assert name not in out, f"{name} twice"
        samples = {}
        for s in fam.samples:
            assert s.name == name, f"{s.name}: not a sample of {name} (no _created series)"
            samples[frozenset(s.labels.items())] = s.value
        out[name] = (fam.type, fam.documentation, samples)
    return out


# ---- one table, one convention -----------------------------------------------------------


def test_names_follow_one_convention() -> None:
    assert len(DECLARED) == len(METRICS), "a name declared twice"
    for m in METRICS:
        # snake_case, no `_total` (prometheus_client adds it to counters), no prefix in code
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", m.name), m.name
        assert not m.name.endswith("_total") and not m.name.startswith(PREFIX), m.name
        assert m.kind in ("counter", "gauge"), m.name
        assert m.help[:1].isupper() or m.help[:1].isdigit(), m.name
        assert m.help.endswith("."), m.name
        assert len(set(m.labels)) == len(m.labels), m.name
        assert set(m.values) <= set(m.labels), m.name
        assert not m.copied or m.kind == "counter", m.name
        assert m.exposed == PREFIX + m.name + ("_total" if m.kind == "counter" else "")


def test_label_value_sets_match_their_owners() -> None:
    copied = {m.name for m in METRICS if m.copied}
    kernel = {"kernel_" + n for n in decode.KERNEL_COUNTERS.values()}
    # the agent's own CPU (psutil) and the per-port sums of what the CPU budget shed (a kernel map)
    budget = {"requests_sampled_out", "requests_sampled_out_seconds"}
    # ... and of what the kernel kept because no span is made of it (the same map)
    kept = {
        "requests_aggregated",
        "requests_aggregated_seconds",
        "requests_aggregated_latency_bucket",
    }
    assert copied == kernel | {"process_cpu_seconds"} | budget | kept
    assert set(DECLARED["requests_aggregated"].values["why"]) == (
        set(probes.AGG_WHY.values()) - {"shed"}
    )
    assert set(DECLARED["traceparent_rejected"].values["reason"]) == set(traceparent.REASONS)
    signals = {s.name for s in probes.OPTIONAL_SIGNALS} | {"page_faults", *probes.CUDA_SIGNALS}
    signals.add(probes.HTTP2_SIGNAL)
    tlb_modes = {"hardware", "flush_fallback", "off"}  # ProbeStatus.tlb_mode
    want = signals | {"tlb_" + mode for mode in tlb_modes}
    assert set(DECLARED["probe_mode"].values["signal"]) == want


# the receivers the code gives a Metrics: metrics, self.metrics, self._m, m
_USE = re.compile(r'\b(?:metrics|_m|m)\.(?:inc|set|get|total|declare)\(\s*"([a-z0-9_]+)"')
_CONSTANT = re.compile(r"""^[A-Z_]+ = "([a-z0-9_]+)"$""", re.MULTILINE)


def test_every_metric_named_in_the_code_is_declared_and_every_declared_one_is_used() -> None:
    """The static half of "a typo is an error": a name in a rarely taken branch (an except:)
    fails here, not on the day that branch runs."""
    used: set[str] = set()
    sources = [p for d in ("agent", "exporters") for p in (ROOT / d).rglob("*.py")]
    for path in sources:
        text = path.read_text()
        used |= set(_USE.findall(text))
        if path.name in ("queue.py", "health.py"):  # names kept as module constants
            used |= set(_CONSTANT.findall(text))
    used.discard("kernel_")  # "kernel_" + name: the copied counters, checked above
    assert used - set(DECLARED) == set(), "named in the code, not declared"
    not_copied = {m.name for m in METRICS if not m.copied}
    assert not_copied - used == set(), "declared, never counted"


# ---- a typo is an error, not a new series ------------------------------------------------


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.inc("records_recieved"),
        lambda m: m.set("redy", 1),
        lambda m: m.get("spans_exportd", exporter="otlp"),
        lambda m: m.total("gpu_samples_total"),  # the served name is not the name
        lambda m: m.declare("spans_droped", exporter="otlp"),
    ],
)
def test_unknown_name_raises(call) -> None:
    m = Metrics()
    before = m.prometheus_text()
    with pytest.raises(KeyError, match="unknown metric"):
        call(m)
    assert m.prometheus_text() == before


@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.inc("spans_exported", exporter_name="otlp"),  # wrong label name
        lambda m: m.inc("spans_exported"),  # label missing
        lambda m: m.inc("records_received", reason="x"),  # label not declared
        lambda m: m.inc("decode_errors", reason="shrot"),  # not one of the reasons
        lambda m: m.inc("spans_dropped", exporter="otlp", reason="queue-full"),
        lambda m: m.set("probe_mode", 1, signal="recvQ"),
        lambda m: m.inc("gpu_samples", device=0),  # label values are strings
        lambda m: m.get("spans_dropped", exporter="otlp"),  # get is one series: all labels
        lambda m: m.total("spans_dropped", reson="shutdown"),
        lambda m: m.declare("gpu_samples"),  # device is open: no way to know its values
        lambda m: m.inc("ready"),  # a gauge is set
        lambda m: m.set("spans_built", 3),  # a counter counted here is inc'd
        lambda m: m.inc("kernel_ringbuf_full"),  # the kernel's counters are copied in
    ],
)
def test_wrong_labels_or_kind_raise(call) -> None:
    m = Metrics()
    before = m.prometheus_text()
    with pytest.raises(ValueError):
        call(m)
    assert m.prometheus_text() == before


def test_a_call_site_checked_once_is_cached_and_still_counts_exactly() -> None:
    m = Metrics()
    for _ in range(3):
        m.inc("spans_dropped", 2, exporter="otlp", reason="shutdown")
        m.inc("spans_dropped", 1, reason="shutdown", exporter="otlp")  # other order, same series
    assert m.get("spans_dropped", exporter="otlp", reason="shutdown") == 9
    with pytest.raises(ValueError):  # a bad value is refused on a hot, cached name too
        m.inc("spans_dropped", 1, exporter="otlp", reason="shutdwn")


def test_concurrent_increments_are_not_lost() -> None:
    m = Metrics()
    n, threads = 20_000, 4

    def work() -> None:
        for _ in range(n):
            m.inc("records_received")
            m.inc("gpu_nvml_call_seconds", 0.5, function="f")

    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert m.get("records_received") == n * threads
    assert m.get("gpu_nvml_call_seconds", function="f") == n * threads * 0.5


# ---- exposition --------------------------------------------------------------------------


def test_exposition_has_help_and_type_for_every_declared_metric() -> None:
    got = served(Metrics())
    assert set(got) == {m.exposed for m in METRICS}
    for m in METRICS:
        kind, help_text, _ = got[m.exposed]
        assert (kind, help_text) == (m.kind, m.help), m.name


def test_the_exposition_is_byte_for_byte_prometheus_clients() -> None:
    """prometheus_text writes what prometheus_client's generate_latest writes for the same
    values: every declared metric, a series for each, labels sorted by name and escaped
    (backslash, newline, double quote, non-ASCII), values as Go formats them (integers as
    floats, large ones in exponent form, +Inf), after a series changed and after new ones came."""
    m = Metrics()
    assert m.prometheus_text() == m.prometheus_text_reference()
    for i, met in enumerate(METRICS):
        labels = {
            label: (met.values[label][-1] if label in met.values else f'v"{i}\\\né')
            for label in met.labels
        }
        value = (i * 1_000_003.25, float("inf"), 0.1, 12_345_678_901)[i % 4]
        if met.kind == "counter" and not met.copied:
            m.inc(met.name, value, **labels)
        else:
            m.set(met.name, value, **labels)
    first = m.prometheus_text()
    assert first == m.prometheus_text_reference()
    m.inc("spans_exported", 5, exporter="otlp")
    m.inc("spans_exported", 1, exporter="a-new-one")
    assert m.prometheus_text() == m.prometheus_text_reference() != first


def test_series_known_up_front_start_at_zero() -> None:
    got = served(Metrics())
    for m in METRICS:
        samples = got[m.exposed][2]
        if all(label in m.values for label in m.labels):
            n = 1
            for label in m.labels:
                n *= len(m.values[label])
            assert len(samples) == n and set(samples.values()) == {0}, m.name
        else:
            assert samples == {}, m.name  # an open label: nothing to guess
    assert got["tracejoin_traceparent_rejected_total"][2][frozenset({("reason", "uppercase")})] == 0


def test_an_export_queue_declares_its_destination_series() -> None:
    m = Metrics()
    BatchExportQueue(InMemoryExporter(), m, name="otlp")
    got = served(m)
    assert got["tracejoin_spans_exported_total"][2] == {frozenset({("exporter", "otlp")}): 0}
    assert got["tracejoin_export_retries_total"][2] == {frozenset({("exporter", "otlp")}): 0}
    assert got["tracejoin_export_failures_total"][2] == {frozenset({("exporter", "otlp")}): 0}
    dropped = got["tracejoin_spans_dropped_total"][2]
    assert dropped == {
        frozenset({("exporter", "otlp"), ("reason", r)}): 0
        for r in DECLARED["spans_dropped"].values["reason"]
    }


def test_values_kinds_and_sums() -> None:
    m = Metrics()
    m.inc("spans_exported", 3, exporter="file")
    m.inc("spans_exported", 4, exporter="otlp")
    m.set("kernel_ringbuf_full", 7)
    m.set("kernel_ringbuf_full", 9)  # a running total: the last copy wins
    m.set("gpu_field_unsupported", 1, device="0", field="power")
    m.inc("gpu_nvml_call_seconds", 0.25, function="nvmlDeviceGetPowerUsage")
    assert m.get("spans_exported", exporter="otlp") == 4
    assert m.get("spans_exported", exporter="nobody") == 0  # a valid series not yet touched
    assert m.total("spans_exported") == 7
    assert m.total("spans_exported", exporter="file") == 3
    assert m.total("spans_dropped", reason="shutdown") == 0
    snap = m.snapshot()
    assert sorted((d["exporter"], v) for d, v in snap["spans_exported"]) == [
        ("file", 3),
        ("otlp", 4),
    ]
    assert snap["kernel_ringbuf_full"] == [({}, 9)]
    assert "gpu_samples" not in snap  # open label, never counted: no series
    got = served(m)
    assert got["tracejoin_kernel_ringbuf_full_total"][0] == "counter"
    assert got["tracejoin_kernel_ringbuf_full_total"][2] == {frozenset(): 9}
    assert got["tracejoin_gpu_field_unsupported"][2] == {
        frozenset({("device", "0"), ("field", "power")}): 1
    }
    calls = got["tracejoin_gpu_nvml_call_seconds_total"][2]
    assert calls == {frozenset({("function", "nvmlDeviceGetPowerUsage")}): 0.25}


def test_each_metrics_object_is_its_own_registry() -> None:
    a, b = Metrics(), Metrics()
    a.inc("records_received", 5)
    assert b.get("records_received") == 0
    assert a.registry is not b.registry
    assert served(b)["tracejoin_records_received_total"][2] == {frozenset(): 0}


# ---- the documented table is the table ---------------------------------------------------


def doc_table(metrics: tuple[Metric, ...]) -> str:
    """docs/attributes.md's Self-metrics table as METRICS says it should read."""
    rows = ["| name | type | labels | meaning |", "|---|---|---|---|"]
    for m in metrics:
        labels = "; ".join(
            f"`{label}`"
            + (": " + ", ".join(f"`{v}`" for v in m.values[label]) if label in m.values else "")
            for label in m.labels
        )
        cells = (f"`{m.exposed}`", m.kind, labels, m.help)
        rows.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return "\n".join(rows) + "\n"


def test_docs_list_exactly_the_declared_metrics() -> None:
    doc = (ROOT / "docs" / "attributes.md").read_text()
    section = doc[doc.index("## Self-metrics") :]
    start = section.index("| name | type | labels | meaning |")
    end = section.index("\n\n", start) + 1
    want = doc_table(METRICS)
    assert section[start:end] == want, "docs/attributes.md, Self-metrics, should read:\n" + want


def test_module_is_the_ground_floor() -> None:
    """tracejoin.core.metrics imports nothing of tracejoin's outside the ground floor (the
    layering rule; make lint checks the whole graph)."""
    src = Path(core_metrics.__file__).read_text()
    assert not re.search(r"^\s*(from|import) tracejoin(?!\.core\.)", src, re.MULTILINE)
