"""The `tracejoin` command: doctor, capture, run, report, ebpf."""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import click
from tracejoin import __version__
from tracejoin.app import probe_config
from tracejoin.config import ConfigError, Settings, apply_options, config_file_option
from tracejoin.core.metrics import Metrics
from tracejoin.kernel.probes import ProbeError

log = logging.getLogger("tracejoin")


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="tracejoin")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """tracejoin: what the kernel and the GPU did to each HTTP request, as a span in the
    caller's trace.

    \b
    tracejoin doctor     what this host supports, and how to fix what it lacks
    tracejoin capture    a one-off capture: live view, summary and files to keep
    tracejoin run        the agent (a DaemonSet): export until SIGTERM
    tracejoin report     the capture summary again, from saved files
    """
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# ------------------------------------------------------------------------------- doctor


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option(
    "--disable-tracepoint",
    multiple=True,
    envvar="TRACEJOIN_DISABLE_TRACEPOINTS",
    help="Treat this tracepoint as absent (repeatable).",
)
@click.option(
    "--bpf-cache",
    default=None,
    envvar="TRACEJOIN_BPF_CACHE",
    help="The directory of kept compiled probes to check (default: run's, "
    "/var/cache/tracejoin/bpf).",
)
def doctor(as_json: bool, disable_tracepoint: tuple[str, ...], bpf_cache: str | None) -> None:
    """Check every signal tracejoin offers: available, fallback (which), or unavailable (why,
    and what would fix it). Exits 0 when the core pipeline can run."""
    from tracejoin.host.doctor import DoctorOptions, run_checks, running_agent, running_agent_text

    opts = DoctorOptions(disabled_tracepoints=frozenset(disable_tracepoint))
    if bpf_cache:
        opts = replace(opts, bpf_cache=Path(bpf_cache))
    report = run_checks(opts)
    port = int(os.environ.get("TRACEJOIN_METRICS_PORT") or 9464)
    agent = running_agent(port) if port else None
    if as_json:
        click.echo(json.dumps({**report.to_json(), "running_agent": agent}, indent=2))
    else:
        click.echo(report.format_text() + "\n" + running_agent_text(port, agent))
    sys.exit(report.exit_code)


def _require_root() -> None:
    """Fail before compiling anything when the effective capabilities cannot load the probes.
    CapEff decides, not the uid: root in a container can lack CAP_BPF."""
    from tracejoin.host.doctor import missing_capabilities

    missing = missing_capabilities()
    if missing:
        raise click.ClickException(
            f"missing capabilities {', '.join(missing)}: grant them, or run as root with them "
            "(see docs/operations.md)"
        )


# ------------------------------------------------------------------------------- capture


@main.command()
@apply_options("capture")
def capture(**params: Any) -> None:
    """Capture HTTP requests on this host for a while, then print where the time went.

    Writes to OUTPUT_DIR: the spans as OTLP/JSON (spans.otlp.jsonl), a timeline for
    ui.perfetto.dev or chrome://tracing (trace.perfetto.json), the summary (summary.txt), loss
    counters (counters.json) and the capture's details (capture.json); with --otlp-endpoint
    the spans also go there. Ctrl-C ends the capture early and still writes everything.
    See docs/capture.md.
    """
    from tracejoin.commands.capture import run_capture

    s = Settings.from_click(click.get_current_context(), params)
    _require_root()
    sys.exit(run_capture(s))


# ------------------------------------------------------------------------------- run


@main.command()
@config_file_option("run")
@click.option(
    "--spans-file",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    envvar="TRACEJOIN_SPANS_FILE",
    help="Write OTLP-JSON lines here (the default destination when no OTLP "
    "endpoint is set). [env: TRACEJOIN_SPANS_FILE]",
)
@apply_options("run")
def run(spans_file: Path | None, **params: Any) -> None:
    """Run the agent until SIGTERM/SIGINT: export one span per request, serve /healthz,
    /readyz and /metrics. On SIGTERM: detach the probes, flush for what is left of
    --shutdown-timeout, and be gone at most 1 s after it (a second signal exits at once)."""
    from tracejoin.commands.run import run_daemon

    s = Settings.from_click(click.get_current_context(), params)
    _require_root()
    code = run_daemon(s, spans_file)
    # Everything is flushed or counted as dropped by now. Skip the interpreter's teardown:
    # destructors it would run (gRPC channels, libbcc objects) take unbounded time and would
    # break the documented exit bound (agent/daemon.py).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------------- report


@main.command()
@click.argument("path", type=click.Path(exists=True, path_type=Path))
def report(path: Path) -> None:
    """Print a capture's summary again from its saved files.

    PATH is a capture directory (or any file in it), or an OTLP/JSON spans file: one
    ExportTraceServiceRequest per line, or one whole document."""
    from tracejoin.commands.summary import load_report
    from tracejoin.core.text import terminal_safe

    try:
        summary = load_report(path)
    except (OSError, ValueError, KeyError) as exc:
        # the message may quote the file's content: escaped like the summary
        raise click.ClickException(terminal_safe(f"cannot read {path}: {exc}")) from exc
    click.echo(summary.format())


# ------------------------------------------------------------------------------- ebpf


@main.command()
@apply_options("capture")
def ebpf(**params: Any) -> None:
    """Print the BPF C and the compiler flags exactly as they would be loaded."""
    from tracejoin.kernel.probes import HttpProbes

    s = Settings.from_click(click.get_current_context(), params)
    try:
        src, flags = HttpProbes(probe_config(s), Metrics()).render()
    except ProbeError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"// cflags: {' '.join(flags)}")
    click.echo(src)


__all__ = ["ConfigError", "main"]
