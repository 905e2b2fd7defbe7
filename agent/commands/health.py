"""/healthz, /readyz and /metrics for `tracejoin run`.

The port answers whatever can reach the pod (or the host), so it must hold against clients that
connect and never finish a request (slow-loris), trickle bytes, or open many connections. It
is one asyncio loop on one thread: a stalled connection costs a few KiB and no thread, and a
complete request is answered on the loop's next turn however many stalled ones are open.

- One request per connection (HTTP/1.0, `Connection: close`); its head (request line and
  headers) at most HEAD_BYTES, else 431.
- `timeout_s` in all per connection, from accept to the last byte of the answer, however the
  client trickles: then it is closed.
- At most `max_connections` open. One more closes the oldest connection of the peer (client
  address) holding the most: a client that floods or stalls connections displaces its own, not
  the Prometheus scrape or the kubelet probe from another address, which send their whole
  request at once and are answered on the loop's next turn.

Every connection closed unanswered is counted in
tracejoin_metrics_server_connections_dropped_total{reason="timeout"|"over_limit"|"head_too_large"}.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections import Counter
from typing import Any

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from tracejoin.core.metrics import Metrics

log = logging.getLogger(__name__)

HEAD_BYTES = 8192  # request line + headers; a scrape or a probe sends a few hundred
DROPPED = "metrics_server_connections_dropped"
_REASONS = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    400: "Bad Request",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


def _listen(address: str, port: int) -> socket.socket:
    """A listening TCP socket, IPv4 or IPv6 by the address (a pod IP can be either)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(
        address or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)  # "::" is IPv6 only
        sock.bind(sockaddr)
        sock.listen(128)  # a burst of connections waits here, not in SYN retries
    except OSError:
        sock.close()
        raise
    return sock


class HealthServer:
    """/healthz (alive: the reader thread runs once started), /readyz (probes attached and not
    stopping), /metrics (Prometheus text). `address`: one address or several, comma-separated.
    Binds at construction (a taken port or a bad address is a start-up error); start/shutdown
    are idempotent."""

    def __init__(
        self,
        address: str,
        port: int,
        metrics: Metrics,
        pipeline: Any = None,
        *,
        max_connections: int = 64,
        timeout_s: float = 5.0,
    ) -> None:
        self.metrics = metrics
        self.pipeline = pipeline
        self.loaded = False  # set once the probes are attached and the gauges say so
        self.stopping = False
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        # One listening socket per comma-separated address, all on one port (the first one's
        # when port is 0): the DaemonSet binds the pod IP and the pod's loopback.
        self._socks: list[socket.socket] = []
        try:
            for addr in [a.strip() for a in address.split(",")] or [""]:
                self._socks.append(_listen(addr, port))
                port = self._socks[0].getsockname()[1]
        except OSError:
            for sock in self._socks:
                sock.close()
            raise
        self.port: int = port
        # open connection -> its peer's address; dict order is accept order
        self._open: dict[asyncio.StreamWriter, str] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._running = threading.Event()

    # ------------------------------------------------------------------ what is served

    def ready(self) -> bool:
        return self.loaded and not self.stopping

    def alive(self) -> bool:
        if self.pipeline is None or not self.loaded or self.stopping:
            return True
        return bool(self.pipeline.alive())

    def refresh(self) -> None:
        """Bring the gauges read at scrape time up to date; never fails the scrape."""
        self.metrics.set("ready", 1 if self.ready() else 0)
        if self.pipeline is not None:
            try:
                self.pipeline.refresh_metrics()
            except Exception:  # maps closing under a concurrent shutdown
                log.debug("kernel counters unavailable", exc_info=True)

    def answer(self, method: str, target: str) -> tuple[int, str, str]:
        """(status, content type, body) for one request."""
        if method != "GET":
            return 405, "text/plain", "GET only\n"
        path = target.split("?", 1)[0]
        if path == "/healthz":
            alive = self.alive()
            return (200, "text/plain", "ok\n") if alive else (503, "text/plain", "reader stopped\n")
        if path == "/readyz":
            if self.ready():
                return 200, "text/plain", "ready\n"
            return 503, "text/plain", "stopping\n" if self.stopping else "starting\n"
        if path == "/metrics":
            self.refresh()
            body = self.metrics.prometheus_text()
            return 200, CONTENT_TYPE_PLAIN_0_0_4, body
        return 404, "text/plain", "not found\n"

    # ------------------------------------------------------------------ connections

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str((writer.get_extra_info("peername") or ("?",))[0])
        self._open[writer] = peer
        while len(self._open) > self.max_connections:
            hog, _ = Counter(self._open.values()).most_common(1)[0]
            oldest = next(w for w, p in self._open.items() if p == hog)
            del self._open[oldest]
            oldest.transport.abort()  # its pending read ends; its task finishes
            self.metrics.inc(DROPPED, reason="over_limit")
        if writer not in self._open:
            writer.transport.abort()
            return
        try:
            async with asyncio.timeout(self.timeout_s):
                status = await self._serve(reader, writer)
            if status == 431:
                self.metrics.inc(DROPPED, reason="head_too_large")
        except TimeoutError:
            if writer in self._open:
                self.metrics.inc(DROPPED, reason="timeout")
        except (OSError, asyncio.CancelledError):
            pass  # reset, closed to make room, or the server is shutting down
        except Exception:  # a bug here must not end the loop that serves every probe
            log.exception("metrics server: unexpected error answering a request")
        finally:
            self._open.pop(writer, None)
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> int:
        head = b""
        while not head.endswith((b"\r\n\r\n", b"\n\n")):
            try:
                line = await reader.readline()  # b"" at end of file
            except ValueError:  # one line longer than the reader's limit (HEAD_BYTES)
                line = b"x" * (HEAD_BYTES + 1)
            if not line:
                return 0  # closed before a whole request: nothing to answer
            head += line
            if len(head) > HEAD_BYTES:
                return await self._write(writer, 431, "text/plain", "request head too large\n")
        parts = head.split(b"\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return await self._write(writer, 400, "text/plain", "bad request\n")
        method, target = parts[0].decode("latin-1"), parts[1].decode("latin-1")
        return await self._write(writer, *self.answer(method, target))

    async def _write(self, writer: asyncio.StreamWriter, status: int, ctype: str, body: str) -> int:
        data = body.encode()
        writer.write(
            f"HTTP/1.0 {status} {_REASONS.get(status, '')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        return status

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        servers = [
            await asyncio.start_server(self._connection, sock=sock, limit=HEAD_BYTES)
            for sock in self._socks
        ]
        self._running.set()
        try:
            await self._stop.wait()
        finally:
            for server in servers:
                server.close()
            for writer in list(self._open):
                writer.transport.abort()
            for server in servers:
                await server.wait_closed()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=asyncio.run, args=(self._main(),), daemon=True, name="tracejoin-health"
            )
            self._thread.start()
            self._running.wait(5.0)

    def shutdown(self) -> None:
        if self._thread is not None:
            if self._loop is not None and self._stop is not None:
                with contextlib.suppress(RuntimeError):  # the loop already ended
                    self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(5.0)
            self._thread = None
        for sock in self._socks:
            sock.close()
