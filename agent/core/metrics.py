"""Self-metrics: monotonically increasing counters and last-value gauges, with labels.

One Metrics object is shared by every stage; each stage only adds to its own names. Reads
(`snapshot`) take the lock; increments are cheap enough for the per-request path.

Names are kept without a unit suffix (`records_received`); the Prometheus rendering adds
`_total` to counters (docs/attributes.md, "Self-metrics"). A value kept elsewhere as a running
total and copied in with `set` (the kernel's counters) is declared with
`describe(..., kind="counter")` so it is exposed as the counter it is.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

Labels = tuple[tuple[str, str], ...]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, Labels], float] = {}
        self._gauges: dict[tuple[str, Labels], float] = {}
        self._help: dict[str, str] = {}
        self._kind: dict[str, str] = {}

    def describe(self, name: str, help_text: str, kind: str | None = None) -> None:
        """Help text for `name`; kind="counter" exposes a `set` value as a counter."""
        if kind not in (None, "counter", "gauge"):
            raise ValueError(f"kind must be 'counter' or 'gauge', not {kind!r}")
        self._help[name] = help_text
        if kind is not None:
            self._kind[name] = kind

    def inc(self, name: str, value: float = 1, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._counters[key] = self._counters.get(key, 0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            self._gauges[key] = value

    def get(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        with self._lock:
            return self._counters.get(key, self._gauges.get(key, 0))

    def total(self, name: str) -> float:
        """Sum of a counter over all label sets."""
        with self._lock:
            return sum(v for (n, _), v in self._counters.items() if n == name)

    def snapshot(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        with self._lock:
            for (name, labels), value in [*self._counters.items(), *self._gauges.items()]:
                out.setdefault(name, []).append((dict(labels), value))
        return out

    def prometheus_text(self, prefix: str = "tracejoin_") -> str:
        """Render in the Prometheus text exposition format (version 0.0.4): HELP and TYPE per
        family, counters named with a `_total` suffix, integral values printed exactly."""
        families: dict[tuple[str, str], list[tuple[Labels, float]]] = {}
        with self._lock:
            for table, default_kind in ((self._counters, "counter"), (self._gauges, "gauge")):
                for (name, labels), value in table.items():
                    kind = (
                        default_kind if table is self._counters else self._kind.get(name, "gauge")
                    )
                    families.setdefault((name, kind), []).append((labels, value))
            help_text = dict(self._help)
        lines: list[str] = []
        for (name, kind), series in sorted(families.items(), key=lambda f: (f[0][1], f[0][0])):
            full = prefix + name
            if kind == "counter" and not full.endswith("_total"):
                full += "_total"
            if name in help_text:
                lines.append(f"# HELP {full} {_escape_help(help_text[name])}")
            lines.append(f"# TYPE {full} {kind}")
            for labels, value in sorted(series):
                lines.append(f"{full}{_fmt_labels(labels)} {_fmt_value(value)}")
        return "\n".join(lines) + "\n"


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _fmt_value(value: float) -> str:
    if isinstance(value, int) or (
        math.isfinite(value) and value.is_integer() and abs(value) < 2**53
    ):
        return str(int(value))
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _fmt_labels(labels: Iterable[tuple[str, str]]) -> str:
    items = list(labels)
    if not items:
        return ""
    body = ",".join(
        '{}="{}"'.format(k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
        for k, v in items
    )
    return "{" + body + "}"
