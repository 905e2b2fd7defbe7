"""A grpcio server for the HTTP/2 tests: generic handlers over raw bytes (no generated code).

    grpcserver.py PORT

/tj.Echo/Say        unary: echoes the request
/tj.Echo/Stream     server-streaming: the request, three times
/tj.Echo/Fail       unary: aborts with INTERNAL (a non-OK status in the trailers)
/tj.Echo/Collect    client-streaming: the requests, joined
"""

from __future__ import annotations

import sys
from concurrent import futures

import grpc


def say(request: bytes, context: grpc.ServicerContext) -> bytes:
    return request


def stream(request: bytes, context: grpc.ServicerContext):  # type: ignore[no-untyped-def]
    for _ in range(3):
        yield request


def fail(request: bytes, context: grpc.ServicerContext) -> bytes:
    context.abort(grpc.StatusCode.INTERNAL, "tj test failure")
    return b""


def collect(requests, context: grpc.ServicerContext) -> bytes:  # type: ignore[no-untyped-def]
    return b"".join(requests)


def main() -> None:
    port = int(sys.argv[1])
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handlers = {
        "Say": grpc.unary_unary_rpc_method_handler(say),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Fail": grpc.unary_unary_rpc_method_handler(fail),
        "Collect": grpc.stream_unary_rpc_method_handler(collect),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("tj.Echo", handlers),))
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    print("ready", flush=True)
    server.wait_for_termination()


if __name__ == "__main__":
    main()
