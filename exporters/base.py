"""The exporter interface every sender implements, its result type, and its test double.

A sender turns one batch of spans into one request to one destination. It does not retry or
queue: `queue.BatchExportQueue` owns batching, retries and loss counting, so each
sender only has to say whether a failure is worth retrying.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol, runtime_checkable

from tracejoin.core.model import Span


class ExportStatus(enum.Enum):
    SUCCESS = "success"
    RETRYABLE_FAILURE = "retryable_failure"
    PERMANENT_FAILURE = "permanent_failure"


@dataclass(frozen=True, slots=True)
class ExportResult:
    status: ExportStatus
    retry_after_s: float | None = None  # the destination's own hint (Retry-After, gRPC RetryInfo)
    rejected_spans: int = 0  # OTLP partial success: accepted request, these spans were not kept
    detail: str = ""

    # Shared instances for the common, detail-free outcomes.
    SUCCESS: ClassVar[ExportResult]
    RETRYABLE_FAILURE: ClassVar[ExportResult]
    PERMANENT_FAILURE: ClassVar[ExportResult]

    @property
    def ok(self) -> bool:
        return self.status is ExportStatus.SUCCESS

    @property
    def retryable(self) -> bool:
        return self.status is ExportStatus.RETRYABLE_FAILURE

    @classmethod
    def retry(cls, detail: str = "", retry_after_s: float | None = None) -> ExportResult:
        return cls(ExportStatus.RETRYABLE_FAILURE, retry_after_s=retry_after_s, detail=detail)

    @classmethod
    def fail(cls, detail: str = "") -> ExportResult:
        return cls(ExportStatus.PERMANENT_FAILURE, detail=detail)


ExportResult.SUCCESS = ExportResult(ExportStatus.SUCCESS)
ExportResult.RETRYABLE_FAILURE = ExportResult(ExportStatus.RETRYABLE_FAILURE)
ExportResult.PERMANENT_FAILURE = ExportResult(ExportStatus.PERMANENT_FAILURE)


@runtime_checkable
class SpanExporter(Protocol):
    """One destination. `export` is called from one thread at a time; `shutdown` may be called
    from another thread while an export is in flight, must not block, and is idempotent.

    An exporter that only sends OTLP protobuf may say so with a class attribute
    `accepts_encoded = True`: it is then also given model.EncodedSpan (a server span the span
    builder already wrote as bytes), whenever every destination of the pipeline accepts them."""

    def export(self, spans: Sequence[Span], timeout_s: float | None = None) -> ExportResult:
        """Send one batch. `timeout_s` caps this call (network senders); None: their default."""
        ...

    def shutdown(self) -> None: ...


class InMemoryExporter:
    """Test double: keeps what it is given, and can be told to fail or to hang.

    `fail_next(n)` makes the next n calls return `result` (retryable by default) without keeping
    the spans; `block()` makes calls wait until `unblock()` -- ignoring their timeout, like a
    sender whose timeout does not work, which is what a queue's shutdown deadline must survive.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Span] = []
        self._batches: list[int] = []
        self._fail_left = 0
        self._fail_result = ExportResult.RETRYABLE_FAILURE
        self._released = threading.Event()
        self._released.set()
        self.calls = 0
        self.timeouts: list[float | None] = []  # the timeout_s of every call, in order
        self.entered = threading.Event()  # set at the start of every export call
        self.shut_down = False

    def fail_next(self, n: int, result: ExportResult = ExportResult.RETRYABLE_FAILURE) -> None:
        with self._lock:
            self._fail_left = n
            self._fail_result = result

    def block(self) -> None:
        self._released.clear()

    def unblock(self) -> None:
        self._released.set()

    def export(self, spans: Sequence[Span], timeout_s: float | None = None) -> ExportResult:
        with self._lock:
            self.calls += 1
            self.timeouts.append(timeout_s)
        self.entered.set()
        self._released.wait()
        with self._lock:
            if self._fail_left > 0:
                self._fail_left -= 1
                return self._fail_result
            self._spans.extend(spans)
            self._batches.append(len(spans))
        return ExportResult.SUCCESS

    @property
    def spans(self) -> list[Span]:
        with self._lock:
            return list(self._spans)

    @property
    def batch_sizes(self) -> list[int]:
        with self._lock:
            return list(self._batches)

    def clear(self) -> None:
        with self._lock:
            self._spans.clear()
            self._batches.clear()

    def shutdown(self) -> None:
        self.shut_down = True
