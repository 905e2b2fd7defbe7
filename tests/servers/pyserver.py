"""Servers the tests control, one process each: `python pyserver.py MODE PORT`.

MODE
  threaded   stdlib ThreadingHTTPServer speaking HTTP/1.1 keep-alive
  workers    the same, its accept loop never waking on a timer, with the hand-off endpoints below
  aiohttp    an asyncio server (aiohttp)
  rawchunks  accepts, reads the request in CHUNK-byte reads (env CHUNK), answers 200
  slowread   accepts, waits until the request has arrived, sleeps SLEEP_MS (env), then reads
  slowaccept sleeps SLEEP_MS before each accept(): connections wait in the backlog
BIND (env) is the address to listen on (default 127.0.0.1).

Endpoints (threaded and aiohttp): /sleep?ms=N, /pages?n=N (touch N fresh pages),
/tlb?n=N (N mmap/munmap rounds while a second thread runs: TLB shootdowns), /spin?ms=N
(burn CPU for N ms of wall time), /file?kb=N
(the body sent with sendfile(2); threaded only), /chunks?n=N (threaded only: a chunked response,
each chunk its own write, the size line, data and CRLF included), anything else: 200 "ok".
Hand-offs (work set tests; threaded, workers): /pool?n=N (a ThreadPoolExecutor worker touches N
pages, the handler waits), /procpool?n=N (the same in a ProcessPoolExecutor worker process),
/fanout?k=K&n=N (K pool threads touch N pages each, the handler waits for all), /bg?n=N&ms=M
(wakes a background thread that sleeps M ms, then touches N pages; the handler does not wait).
aiohttp only: /apages?n=N&chunks=C (touch N pages in C chunks on the loop, yielding 5 ms between
chunks), /asleep?ms=N (await a sleep: open, doing nothing), /aexec?n=N (the loop's default
executor, a thread pool, touches N pages; the handler awaits it).
Prints "ready" on stdout once listening.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import queue
import select
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, wait
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

PAGE = mmap.PAGESIZE


def touch_pages(n: int) -> None:
    if n <= 0:
        return
    m = mmap.mmap(-1, n * PAGE)
    for i in range(n):
        m[i * PAGE] = 1
    m.close()


def tlb_churn(n: int) -> None:
    # munmap of memory another running thread of this process may have cached forces a TLB
    # shootdown on the CPUs that thread ran on.
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)])
    spinner.start()
    for _ in range(n):
        m = mmap.mmap(-1, 16 * PAGE)
        m[0] = 1
        m.close()
    stop.set()
    spinner.join()


_FILES: dict[int, str] = {}
_POOLS: dict[str, ThreadPoolExecutor | ProcessPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()
_BG: queue.SimpleQueue[tuple[int, int]] = queue.SimpleQueue()
_BG_STARTED = threading.Event()


def _die_with_parent() -> None:
    """A worker process ends with the thread that forked it: the server's main thread (the
    tests kill the server, not its children; see serve_threaded)."""
    import ctypes
    import signal

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def pool(kind: str, workers: int) -> ThreadPoolExecutor | ProcessPoolExecutor:
    with _POOLS_LOCK:
        key = f"{kind}{workers}"
        if key not in _POOLS:
            if kind == "proc":
                _POOLS[key] = ProcessPoolExecutor(workers, initializer=_die_with_parent)
            else:
                _POOLS[key] = ThreadPoolExecutor(max_workers=workers)
        return _POOLS[key]


def background() -> None:
    """Sleeps until a handler hands it (pages, delay_ms); works after the response."""
    while True:
        n, ms = _BG.get()
        time.sleep(ms / 1000)
        touch_pages(n)


def body_file(kb: int) -> str:
    if kb not in _FILES:
        fd, path = tempfile.mkstemp(prefix="tj-body-")
        os.write(fd, b"x" * (kb * 1024))
        os.close(fd)
        _FILES[kb] = path
    return _FILES[kb]


def handle(path: str) -> tuple[int, bytes]:
    url = urlsplit(path)
    q = {k: v[0] for k, v in parse_qs(url.query).items()}
    if url.path == "/sleep":
        time.sleep(int(q.get("ms", "0")) / 1000)
    elif url.path == "/pages":
        touch_pages(int(q.get("n", "0")))
    elif url.path == "/tlb":
        tlb_churn(int(q.get("n", "0")))
    elif url.path == "/spin":
        end = time.perf_counter() + int(q.get("ms", "0")) / 1000
        while time.perf_counter() < end:
            pass
    elif url.path == "/pool":
        pool("thread", 2).submit(touch_pages, int(q.get("n", "0"))).result()
    elif url.path == "/procpool":
        pool("proc", 2).submit(touch_pages, int(q.get("n", "0"))).result()
    elif url.path == "/fanout":
        k = int(q.get("k", "1"))
        ex = pool("thread", k)
        wait([ex.submit(touch_pages, int(q.get("n", "0"))) for _ in range(k)])
    elif url.path == "/bg":
        with _POOLS_LOCK:
            if not _BG_STARTED.is_set():  # started once, on first use
                threading.Thread(target=background, daemon=True).start()
                _BG_STARTED.set()
        _BG.put((int(q.get("n", "0")), int(q.get("ms", "0"))))
    elif url.path == "/error":
        return 503, b"unavailable\n"
    return 200, b"ok\n"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        if url.path == "/file":
            kb = int(parse_qs(url.query).get("kb", ["64"])[0])
            path = body_file(kb)
            self.send_response(200)
            self.send_header("Content-Length", str(kb * 1024))
            self.end_headers()
            self.wfile.flush()
            with open(path, "rb") as fh:
                self.connection.sendfile(fh)
            return
        if url.path == "/chunks":
            n = int(parse_qs(url.query).get("n", ["3"])[0])
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(n):
                data = f"row {i},0\r\n".encode()  # ends like the terminator
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.write(b"0\r\n\r\n")
            return
        code, body = handle(self.path)
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        n = int(self.headers.get("Content-Length", "0"))
        self.rfile.read(n)
        self.do_GET()

    def log_message(self, *args: object) -> None:
        pass


class NoDelayHandler(Handler):
    # headers and body go out in two writes: without TCP_NODELAY the body waits for the
    # client's delayed ACK (40 ms), and a benchmark would measure that
    disable_nagle_algorithm = True

    def handle(self) -> None:
        with contextlib.suppress(ConnectionError):  # a load generator hanging up at its end
            super().handle()


def serve_threaded(port: int, poll_interval: float = 0.5) -> None:
    handler = Handler if poll_interval < 3600 else NoDelayHandler
    if handler is NoDelayHandler:  # workers: fork the worker processes from the main thread
        procs = pool("proc", 2)
        wait([procs.submit(touch_pages, 0) for _ in range(2)])
    srv = ThreadingHTTPServer((os.environ.get("BIND", "127.0.0.1"), port), handler)
    srv.daemon_threads = True
    print("ready", flush=True)
    # workers: the accept loop never wakes on its own, so it never takes the GIL from a handler
    # (a GIL hand-off is a wake, and would add it to that request's work set)
    srv.serve_forever(poll_interval=poll_interval)


def serve_aiohttp(port: int) -> None:
    import asyncio

    from aiohttp import web

    async def any_path(request: web.Request) -> web.Response:
        q = request.rel_url.query
        if request.path == "/apages":
            n, chunks = int(q.get("n", "0")), int(q.get("chunks", "1"))
            for _ in range(chunks):
                touch_pages(n // chunks)
                await asyncio.sleep(0.005)
            return web.Response(body=b"ok\n")
        if request.path == "/asleep":
            await asyncio.sleep(int(q.get("ms", "0")) / 1000)
            return web.Response(body=b"ok\n")
        if request.path == "/aexec":
            n = int(q.get("n", "0"))
            await asyncio.get_running_loop().run_in_executor(None, touch_pages, n)
            return web.Response(body=b"ok\n")
        code, body = handle(str(request.rel_url))
        return web.Response(status=code, body=body)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_path)
    print("ready", flush=True)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n"


def serve_raw(port: int, mode: str) -> None:
    chunk = int(os.environ.get("CHUNK", "4096"))
    sleep_ms = int(os.environ.get("SLEEP_MS", "0"))
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((os.environ.get("BIND", "127.0.0.1"), port))
    lsock.listen(128)
    print("ready", flush=True)
    while True:
        if mode == "slowaccept":  # connections wait in the accept backlog
            time.sleep(sleep_ms / 1000)
        conn, _ = lsock.accept()
        try:
            if mode == "slowread":
                select.select([conn], [], [], 5)
                time.sleep(sleep_ms / 1000)
            data = b""
            while b"\r\n\r\n" not in data:
                part = conn.recv(chunk)
                if not part:
                    break
                data += part
            if data:
                conn.sendall(RESPONSE)
        finally:
            conn.close()


def main() -> None:
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "threaded":
        serve_threaded(port)
    elif mode == "workers":
        serve_threaded(port, poll_interval=3600)
    elif mode == "aiohttp":
        serve_aiohttp(port)
    else:
        serve_raw(port, mode)


if __name__ == "__main__":
    main()
