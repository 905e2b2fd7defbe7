"""Self-metrics: monotonically increasing counters and last-value gauges, with labels.

One Metrics object is shared by every stage; each stage only adds to its own names. Reads
(`snapshot`) take the lock; increments are cheap enough for the per-request path.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

Labels = tuple[tuple[str, str], ...]


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[tuple[str, Labels], float] = {}
        self._gauges: dict[tuple[str, Labels], float] = {}
        self._help: dict[str, str] = {}

    def describe(self, name: str, help_text: str) -> None:
        self._help[name] = help_text

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
        """Render in the Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        with self._lock:
            series = [("counter", self._counters), ("gauge", self._gauges)]
            for kind, table in series:
                names = sorted({n for n, _ in table})
                for name in names:
                    full = prefix + name
                    if name in self._help:
                        lines.append(f"# HELP {full} {self._help[name]}")
                    lines.append(f"# TYPE {full} {kind}")
                    for (n, labels), value in sorted(table.items()):
                        if n == name:
                            lines.append(f"{full}{_fmt_labels(labels)} {value:g}")
        return "\n".join(lines) + "\n"


def _fmt_labels(labels: Iterable[tuple[str, str]]) -> str:
    items = list(labels)
    if not items:
        return ""
    body = ",".join(
        '{}="{}"'.format(k, v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n"))
        for k, v in items
    )
    return "{" + body + "}"
