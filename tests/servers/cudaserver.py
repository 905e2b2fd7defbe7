"""An HTTP server that makes CUDA runtime calls per request, against the test doubles in
tests/cuda_stubs: `python cudaserver.py MODE LIBCUDART PORT`.

MODE
  shared   loads LIBCUDART at start-up
  dlopen   loads it (ctypes.CDLL) on the first /work request: after the agent started
  worker   forks a worker process that loads it; the HTTP front hands each request's work to
           the worker over a pipe and waits for its answer (the front never calls CUDA)
  batch    a thread per connection; one GPU worker thread waits until BATCH (env, default 2)
           requests are queued, makes the calls once for the whole batch, and answers them all

GET /work?n=N: cudaMalloc N bytes, cudaMemcpy them host to device, cudaStreamSynchronize,
cudaMemcpy back, cudaFree; the body is what the stub's cudaMemcpy recorded ("count kind calls").
GET /driver?n=N (shared only): the driver alone, beneath no runtime call: cuMemAlloc_v2 N bytes,
cuMemcpyHtoD_v2 them, cuMemFree_v2 (calls with no return probe: counted at their entry).
One thread serves every request (stdlib HTTPServer; batch: ThreadingHTTPServer), so each
request's reader is known.
Prints "ready" on stdout once listening.
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


class StubMemcpy(ctypes.Structure):
    _fields_ = (
        ("dst", ctypes.c_void_p),
        ("src", ctypes.c_void_p),
        ("count", ctypes.c_size_t),
        ("kind", ctypes.c_int),
        ("calls", ctypes.c_ulong),
    )


class Cuda:
    def __init__(self, path: str) -> None:
        self.lib = ctypes.CDLL(path)
        self.last = StubMemcpy.in_dll(self.lib, "stub_last_memcpy")
        self.driver = ctypes.CDLL("libcuda.so.1")  # loaded already, beneath the runtime

    def driver_work(self, n: int) -> bytes:
        host = ctypes.create_string_buffer(max(n, 1))
        dev = ctypes.c_uint64()
        drv = self.driver
        assert drv.cuMemAlloc_v2(ctypes.byref(dev), ctypes.c_size_t(n)) == 0
        assert drv.cuMemcpyHtoD_v2(dev, host, ctypes.c_size_t(n)) == 0
        assert drv.cuMemFree_v2(dev) == 0
        return b"driver\n"

    def work(self, n: int) -> bytes:
        host = ctypes.create_string_buffer(max(n, 1))
        dev = ctypes.c_void_p()
        lib = self.lib
        assert lib.cudaMalloc(ctypes.byref(dev), ctypes.c_size_t(n)) == 0
        assert lib.cudaMemcpy(dev, host, ctypes.c_size_t(n), 1) == 0
        assert lib.cudaStreamSynchronize(None) == 0
        assert lib.cudaMemcpy(host, dev, ctypes.c_size_t(n), 2) == 0
        assert lib.cudaFree(dev) == 0
        return f"{self.last.count} {self.last.kind} {self.last.calls}\n".encode()


MODE, LIB = sys.argv[1], sys.argv[2]
_cuda: Cuda | None = Cuda(LIB) if MODE == "shared" else None
_to_worker: int = -1
_from_worker: int = -1


def worker(rd: int, wr: int) -> None:
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: ends with the server
    cuda = Cuda(LIB)
    while True:
        raw = os.read(rd, 8)
        if len(raw) < 8:
            os._exit(0)
        body = cuda.work(struct.unpack("<Q", raw)[0])
        os.write(wr, struct.pack("<I", len(body)) + body)


class Batcher:
    """One GPU worker thread serving requests in batches of BATCH: a batching inference
    worker. Its calls serve every request of the batch at once: shared, not any one's own."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.cond = threading.Condition()
        self.queue: list[tuple[int, list[bytes], threading.Event]] = []
        threading.Thread(target=self.run, name="gpu-batcher", daemon=True).start()

    def submit(self, n: int) -> bytes:
        out: list[bytes] = []
        done = threading.Event()
        with self.cond:
            self.queue.append((n, out, done))
            self.cond.notify()
        done.wait()
        return out[0]

    def run(self) -> None:
        cuda = Cuda(LIB)
        while True:
            with self.cond:
                while len(self.queue) < self.size:
                    self.cond.wait()
                batch, self.queue = self.queue[: self.size], self.queue[self.size :]
            body = cuda.work(sum(n for n, _, _ in batch))
            for _, out, done in batch:
                out.append(body)
                done.set()


_batcher: Batcher | None = None


def work(n: int) -> bytes:
    global _cuda
    if _batcher is not None:
        return _batcher.submit(n)
    if MODE == "worker":
        os.write(_to_worker, struct.pack("<Q", n))
        size = struct.unpack("<I", os.read(_from_worker, 4))[0]
        return os.read(_from_worker, size)
    if _cuda is None:  # dlopen: the library appears in this process only now
        _cuda = Cuda(LIB)
    return _cuda.work(n)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        body = b"ok\n"
        n = int(parse_qs(url.query).get("n", ["0"])[0])
        if url.path == "/work":
            body = work(n)
        elif url.path == "/driver" and _cuda is not None:
            body = _cuda.driver_work(n)
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    global _to_worker, _from_worker, _batcher
    if MODE == "worker":
        a_rd, a_wr = os.pipe()
        b_rd, b_wr = os.pipe()
        if os.fork() == 0:
            worker(a_rd, b_wr)
        _to_worker, _from_worker = a_wr, b_rd
    if MODE == "batch":
        _batcher = Batcher(int(os.environ.get("BATCH", "2")))
        threaded = ThreadingHTTPServer(("127.0.0.1", int(sys.argv[3])), Handler)
        threaded.daemon_threads = True
        print("ready", flush=True)
        threaded.serve_forever(poll_interval=3600)
        return
    srv = HTTPServer(("127.0.0.1", int(sys.argv[3])), Handler)
    print("ready", flush=True)
    srv.serve_forever(poll_interval=3600)  # never wakes on a timer: one thread, no GIL hand-off


if __name__ == "__main__":
    main()
