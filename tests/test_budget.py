"""The overload budget (--cpu-budget): the controller, driven by made-up CPU readings, and the
kernel's sampling entry against OpenTelemetry's TraceIdRatioBased. The kernel's keep/drop
decisions themselves are checked against the SDK's sampler in test_reliability.py
(test_budget_sheds_the_same_trace_ids_as_the_otel_sampler)."""

from __future__ import annotations

import itertools
import time

import pytest
from opentelemetry.sdk.trace.sampling import TraceIdRatioBased
from tracejoin.config import Settings
from tracejoin.kernel.probes import sampling_entry
from tracejoin.pipeline.budget import FILL_STEP_S, MIN_RATIO, BudgetController


def drive(ctl: BudgetController, shares: list[float], lost_at: frozenset[int] = frozenset()):
    """Feed one reading a second with the agent at each share of a CPU; ratios after each."""
    t, cpu, lost, out = 0.0, 0.0, 0, []
    ctl.update(t, cpu, lost)
    for i, share in enumerate(shares):
        t += 1.0
        cpu += share
        lost += 100 if i in lost_at else 0
        out.append(ctl.update(t, cpu, lost))
    return out


def test_the_ratio_falls_under_load_and_comes_back_when_it_ends():
    ctl = BudgetController(budget=0.5)
    busy = drive(ctl, [2.0] * 6)
    assert busy[0] == 1.0, "one reading above the budget is not yet overload"
    assert busy[1] < 1.0 and all(b <= a for a, b in itertools.pairwise(busy))
    assert busy[1] == pytest.approx(0.25), "4x over budget: at most a 4x cut at once"
    low = busy[-1]
    assert low >= MIN_RATIO
    quiet = drive(ctl, [0.1] * 30)
    assert quiet[0] > low and quiet[-1] == 1.0, "restored step by step once load falls"
    assert all(b >= a for a, b in itertools.pairwise(quiet))


def test_cut_is_proportional_to_the_overshoot_and_never_below_the_floor():
    ctl = BudgetController(budget=0.5)
    assert drive(ctl, [0.6, 0.6])[-1] == pytest.approx(0.9 * 0.5 / 0.6)
    assert drive(BudgetController(budget=0.5), [50.0] * 40)[-1] == MIN_RATIO


def test_ring_losses_halve_the_ratio_only_while_the_agent_is_busy():
    busy = drive(BudgetController(budget=0.5), [0.4, 0.4], lost_at=frozenset({1}))
    assert busy == [1.0, 0.5]
    # losses while the agent barely ran (stopped, or its reader paused): not its load
    idle = drive(BudgetController(budget=0.5), [0.01, 0.01], lost_at=frozenset({0, 1}))
    assert idle == [1.0, 1.0]


def test_between_the_thresholds_the_ratio_holds():
    ctl = BudgetController(budget=0.5)
    drive(ctl, [2.0, 2.0])
    held = ctl.ratio
    assert drive(ctl, [0.45] * 5) == [held] * 5


def test_a_reader_falling_behind_halves_the_ratio_before_the_next_reading():
    """Batches that took half the ring, two in a row: halved at once (the reader is starved
    below its budget too), at most once per FILL_STEP_S, and no raise at the next reading."""
    ctl = BudgetController(budget=0.5)
    ctl.update(0.0, 0.0, 0)
    assert ctl.filled(0.10, 0.9) == 1.0, "one full batch is a backlog (a paused reader)"
    assert ctl.filled(0.125, 0.1) == 1.0
    assert ctl.filled(0.15, 0.6) == 1.0
    assert ctl.filled(0.175, 0.6) == 0.5, "the second in a row: behind"
    assert ctl.filled(0.2, 0.7) == 0.5, "the same backlog, seen again within FILL_STEP_S"
    assert ctl.filled(0.175 + FILL_STEP_S, 0.7) == 0.25
    # the agent's CPU share is low (it was starved), nothing lost: no raise this time...
    assert ctl.update(1.0, 0.1, 0) == 0.25
    # ...and raised again once a whole interval passed without a full batch
    assert ctl.filled(1.5, 0.05) == 0.25
    assert ctl.update(2.0, 0.2, 0) == pytest.approx(0.375)


def test_a_backlog_being_caught_up_with_is_not_halved_again():
    ctl = BudgetController(budget=0.5)
    assert [ctl.filled(t, f) for t, f in [(0.0, 1.0), (0.05, 1.0)]] == [1.0, 0.5]
    draining = [(0.2, 0.9), (0.4, 0.8), (0.6, 0.7), (0.8, 0.55), (1.0, 0.3)]
    assert [ctl.filled(t, f) for t, f in draining] == [0.5] * 5
    # growing again: behind again
    assert [ctl.filled(t, f) for t, f in [(1.2, 0.6), (1.4, 0.7)]] == [0.5, 0.25]


def test_a_backlog_that_barely_shrinks_is_still_behind():
    """A starved reader drains a full ring a little per batch while new records refill it: it
    is losing, not catching up, so the ratio is halved again."""
    ctl = BudgetController(budget=0.5)
    seen = [ctl.filled(t, f) for t, f in [(0.0, 1.0), (0.2, 0.99), (0.4, 0.97), (0.6, 0.96)]]
    assert seen == [1.0, 0.5, 0.25, 0.125]


def test_losses_the_fill_rule_answered_are_not_halved_for_again():
    ctl = BudgetController(budget=0.5)
    ctl.update(0.0, 0.0, 0)
    assert [ctl.filled(t, 0.9) for t in (0.1, 0.2)] == [1.0, 0.5]
    # the ring overflowed before that halving took hold, with the agent busy: not halved again
    assert ctl.update(1.0, 0.3, 500) == 0.5
    # losses in a later interval without a fill-lowering still halve
    assert ctl.update(2.0, 0.6, 900) == 0.25


def test_fill_changes_nothing_with_the_budget_off():
    ctl = BudgetController(budget=0.0)
    assert [ctl.filled(t / 10, 1.0) for t in range(10)] == [1.0] * 10


def test_budget_zero_is_off():
    assert drive(BudgetController(budget=0.0), [5.0] * 5) == [1.0] * 5


@pytest.mark.parametrize("ratio", [0.0, 1e-6, 0.001, 0.25, 0.5, 0.7391, 0.999999])
def test_the_kernel_bound_is_the_sdk_bound(ratio):
    entry = sampling_entry(ratio)
    assert entry.active == 1
    assert entry.bound == TraceIdRatioBased.get_bound_for_rate(ratio)


def test_ratio_one_switches_the_kernel_check_off():
    assert sampling_entry(1.0).active == 0
    assert sampling_entry(3.0).active == 0


def test_cpu_budget_option_has_a_documented_default():
    assert Settings().cpu_budget == 0.5
    assert Settings().recvq_threshold_ms == 1.0


def test_doctor_shows_a_running_agents_ratio():
    """`tracejoin doctor` reads the ratio from the agent's own /metrics (real Metrics text)."""
    import http.server
    import threading

    from tracejoin.core.metrics import Metrics
    from tracejoin.host.doctor import running_agent, running_agent_text

    m = Metrics()
    m.set("sampling_ratio", 0.25)
    m.set("agent_cpu_share", 0.61)
    m.set("kernel_sampled_out_budget", 1234)
    body = m.prometheus_text().encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_a: object) -> None:
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        port = srv.server_address[1]
        state = running_agent(port)
        assert state == {
            "sampling_ratio": 0.25,
            "agent_cpu_share": 0.61,
            "kernel_sampled_out_budget_total": 1234.0,
        }
        text = running_agent_text(port, state)
        assert "sampling ratio 0.25" in text and "1234 requests sampled out" in text
    finally:
        srv.shutdown()
    assert running_agent(port) is None
    assert "none answering" in running_agent_text(port, None)


def test_start_up_work_after_ready_is_not_load():
    """`tracejoin run` verifies HTTP/2's programs after ready: seconds of the agent's CPU that
    shedding requests would not lower. Skipped readings leave the ratio alone, and the next
    interval starts after them."""
    ctl = BudgetController(budget=0.5)
    t, cpu = 0.0, 0.0
    ctl.update(t, cpu, 0)
    for _ in range(6):  # the verifier: 2 CPUs' worth a second
        t, cpu = t + 1.0, cpu + 2.0
        ctl.skip()
    assert ctl.ratio == 1.0
    t, cpu = t + 1.0, cpu + 0.1
    assert ctl.update(t, cpu, 0) == 1.0  # a fresh baseline, not 12 s of CPU over 1 s
    t, cpu = t + 1.0, cpu + 0.1
    assert ctl.update(t, cpu, 0) == 1.0 and ctl.share == pytest.approx(0.1)


def test_readings_closer_than_the_interval_change_nothing():
    """/metrics scrapes read the budget too: readings a few ms apart are noise (CI: two right
    after HTTP/2's verification read 0.65 of a CPU and shed 30 % of valid requests). They are
    ignored, and the interval runs on from the last full reading."""
    ctl = BudgetController(budget=0.5)
    t, cpu = 0.0, 0.0
    ctl.update(t, cpu, 0)
    for _ in range(5):  # a burst of scrapes, the agent busy for those instants
        t, cpu = t + 0.05, cpu + 0.05
        assert ctl.update(t, cpu, 0) == 1.0
    t, cpu = 1.0, 0.3  # the second: 0.3 of a CPU over it, under the budget
    assert ctl.update(t, cpu, 0) == 1.0 and ctl.share == pytest.approx(0.3)
    assert drive(BudgetController(budget=0.5), [0.9, 0.9])[-1] < 1.0  # real load still sheds


def test_the_agent_skips_the_budget_while_its_source_is_loading():
    from tracejoin.app import build_agent
    from tracejoin.core.metrics import Metrics

    class Loading:  # the probes while HTTP/2's programs are verified after ready
        loading = True

        def __init__(self) -> None:
            self.ratios: list[float] = []

        def set_sampling(self, ratio: float) -> None:
            self.ratios.append(ratio)

    src = Loading()
    agent = build_agent(Settings(gpu=False), Metrics(), [], source=src)  # type: ignore[arg-type]
    for second in range(6):
        agent._apply_budget(cpu_s=2.0 * second, ringbuf_full=0)
    assert src.ratios == [] and agent.budget.ratio == 1.0
    src.loading = False
    for n in range(3):  # a baseline, then two readings far over the budget
        time.sleep(0.95 if n else 0.01)  # a reading's interval (budget.MIN_INTERVAL_S)
        agent._apply_budget(cpu_s=12.0 + n, ringbuf_full=0)
    assert src.ratios and src.ratios[-1] < 1.0, "once loaded, overload lowers the ratio again"


def test_the_agents_tick_steps_the_budget_only_when_there_is_one():
    """`tracejoin run` ticks once a second: with a budget, one step from the agent's CPU and
    the ring's losses; without one, nothing at all (a scrape copies the rest in)."""
    from tracejoin.app import build_agent
    from tracejoin.core.metrics import Metrics

    class Counters:
        reads = 0

        def kernel_counters(self) -> dict[str, int]:
            self.reads += 1
            return {"ringbuf_full": 7}

    for budget, want_steps in ((0.0, 0), (0.5, 1)):
        agent = build_agent(Settings(gpu=False, cpu_budget=budget), Metrics(), [], source=object())  # type: ignore[arg-type]
        steps: list[tuple[float, int]] = []
        agent._apply_budget = (  # type: ignore[method-assign]
            lambda cpu_s, ringbuf_full, steps=steps: steps.append((cpu_s, ringbuf_full))
        )
        agent.tick()  # before start: no pipeline, nothing to read
        agent.pipeline = Counters()  # type: ignore[assignment]
        before = time.process_time()
        agent.tick()
        assert len(steps) == want_steps and agent.pipeline.reads == want_steps
        if steps:
            cpu_s, lost = steps[0]
            assert lost == 7 and before <= cpu_s <= time.process_time()
