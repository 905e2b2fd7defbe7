"""Issue 18 sections 1 and 2: the kernel frames requests and responses the way RFC 9112 says a
server must, and where it cannot be sure it stops trusting the connection, counts why, and
never invents a request.

Real BPF (one in-process agent for the module), real servers (Go net/http, Node.js http,
Python http.server) and a scripted server whose bytes, and the writes that carry them, each
test decides. Every request carries its own trace id and path, so a span can only match the
request it belongs to; "poison" ids sit in bytes that must never become a request.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from harness import Agent, free_ports, server
from hostile import Sent, get_bytes, new_sent
from tracejoin.core.model import KIND_SERVER, Span

pytestmark = pytest.mark.privileged

SETTLE_S = 1.0  # for "no span appears": how long the pipeline is given to deliver one


@dataclass
class Framing:
    agent: Agent
    go_port: int
    py_port: int
    node_port: int
    free: list[int]  # more ports in the agent's filter, one per scripted server

    def port(self) -> int:
        return self.free.pop()

    def counters(self) -> dict[str, int]:
        return self.agent.pipeline.kernel_counters()

    def spans_where(self, pred: Callable[[Span], bool], n: int = 1) -> list[Span]:
        """Server spans matching pred, once n have arrived (or 10 s passed)."""

        def mine(spans: list[Span]) -> list[Span]:
            return [s for s in spans if s.kind == KIND_SERVER and pred(s)]

        return mine(self.agent.wait_for(lambda sp: len(mine(sp)) >= n, 10.0))

    def span_of(self, sent: Sent) -> Span:
        spans = self.spans_where(lambda s: s.trace_id == sent.trace_id)
        assert len(spans) == 1, (sent, spans)
        return spans[0]

    def span_at(self, path: str) -> list[Span]:
        return self.spans_where(lambda s: s.attributes.get("url.path") == path)

    def none_carry(self, *sents: Sent) -> None:
        time.sleep(SETTLE_S)
        ids = {s.trace_id for s in sents}
        paths = {s.path for s in sents}
        bad = [
            s
            for s in self.agent.spans()
            if s.trace_id in ids or s.attributes.get("url.path") in paths
        ]
        assert not bad, f"spans for requests that were never made: {bad}"


@pytest.fixture(scope="module")
def fx(privileged: None) -> Iterator[Framing]:
    go_port, py_port, node_port, *free = free_ports(24)
    with server("go", go_port), server("threaded", py_port), server("node", node_port):
        agent = Agent([go_port, py_port, node_port, *free], None)
        agent.start()
        try:
            yield Framing(agent, go_port, py_port, node_port, free)
        finally:
            agent.shutdown()


def delta(fx: Framing, before: dict[str, int]) -> dict[str, int]:
    now = fx.counters()
    return {k: now[k] - before.get(k, 0) for k in now if now[k] != before.get(k, 0)}


# ------------------------------------------------------------------------------ clients


class Client:
    """One connection; responses read by their own framing (Content-Length or chunked)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def send(self, *parts: bytes, gap_s: float = 0.05) -> None:
        """Each part in its own write, `gap_s` apart, so the server reads them apart."""
        for i, part in enumerate(parts):
            if i:
                time.sleep(gap_s)
            self.sock.sendall(part)

    def _fill(self) -> bool:
        part = self.sock.recv(65536)
        self.buf += part
        return bool(part)

    def response(self, to_head: bool = False) -> tuple[int, bytes]:
        """(status, the whole response as bytes); (0, b"") if the server closed first.
        `to_head`: the response to a HEAD request (no body, whatever its headers say)."""
        while b"\r\n\r\n" not in self.buf and b"\n\n" not in self.buf:
            if not self._fill():
                return 0, b""
        sep = b"\r\n\r\n" if b"\r\n\r\n" in self.buf else b"\n\n"
        head, _, _ = self.buf.partition(sep)
        end = len(head) + len(sep)
        lines = head.replace(b"\r\n", b"\n").split(b"\n")
        status = int(lines[0].split()[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(b":") for ln in lines)}
        if to_head:
            pass
        elif fields.get(b"transfer-encoding", b"").lower() == b"chunked":
            pos = end
            while True:
                while b"\r\n" not in self.buf[pos:]:
                    self._fill()
                line_end = self.buf.index(b"\r\n", pos)
                size = int(self.buf[pos:line_end].split(b";")[0], 16)
                pos = line_end + 2 + size + 2
                while len(self.buf) < pos:
                    self._fill()
                if size == 0:
                    break
            end = pos
        elif b"content-length" in fields:
            end += int(fields[b"content-length"])
            while len(self.buf) < end:
                self._fill()
        elif not (100 <= status < 200 or status in (204, 304)):
            while self._fill():  # close-delimited
                pass
            end = len(self.buf)
        resp, self.buf = self.buf[:end], self.buf[end:]
        return status, resp

    def request(self, payload: bytes, to_head: bool = False) -> int:
        self.sock.sendall(payload)
        return self.response(to_head)[0]

    def close(self) -> None:
        self.sock.close()


class Scripted:
    """A server on `port` that hands each accepted connection to `handler(sock)` in a thread:
    the test decides every byte the server writes and how the writes are cut."""

    def __init__(self, port: int, handler: Callable[[socket.socket], None]) -> None:
        self.handler = handler
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", port))
        self.lsock.listen(16)
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.lsock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.handler(conn)
        except OSError:
            pass
        except BaseException as e:
            self.errors.append(e)
        finally:
            conn.close()

    def __enter__(self) -> Scripted:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lsock.close()
        assert not self.errors, self.errors


class Reader:
    """Server side: request heads read off a connection (bodies framed by Content-Length)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def request(self) -> bytes:
        """The next request's head and body; b"" once the client has closed."""
        while b"\r\n\r\n" not in self.buf and b"\n\n" not in self.buf:
            part = self.sock.recv(65536)
            if not part:
                return b""
            self.buf += part
        sep = b"\r\n\r\n" if b"\r\n\r\n" in self.buf else b"\n\n"
        head, _, rest = self.buf.partition(sep)
        n = 0
        for line in head.split(b"\n"):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                n = int(value)
        while len(rest) < n:
            rest += self.sock.recv(65536)
        self.buf = rest[n:]
        return head + sep + rest[:n]


def ok(status: int = 200, body: bytes = b"ok") -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Length: %d\r\n\r\n%s" % (status, len(body), body)


def serve_each(*writes: Callable[[socket.socket], None]) -> Callable[[socket.socket], None]:
    """A handler that answers the k-th request on a connection with writes[k]."""

    def handler(sock: socket.socket) -> None:
        r = Reader(sock)
        for write in writes:
            if not r.request():
                return
            write(sock)
        while r.request():
            sock.sendall(ok())

    return handler


def tp_header(s: Sent) -> bytes:
    return f"traceparent: {s.traceparent}\r\n".encode()


# ------------------------------------------------------------------------------ requests


def test_length_header_split_across_reads_frames_the_body(fx):
    """`Content-Length` whose name is cut between two reads still frames the body: the fake
    request inside it never opens a request; the next real request is traced."""
    post, fake, after = new_sent("/split/post"), new_sent("/split/fake"), new_sent("/split/after")
    body = get_bytes(fake)
    head = f"POST {post.path} HTTP/1.1\r\nHost: t\r\n".encode() + tp_header(post) + b"Conte"
    rest = f"nt-Length: {len(body)}\r\n\r\n".encode() + body
    c = Client(fx.go_port)
    c.send(head, rest)
    assert c.response()[0] == 200
    assert c.request(get_bytes(after)) == 200
    c.close()
    span = fx.span_of(post)
    assert span.attributes["url.path"] == post.path
    assert span.attributes["http.request.size"] == len(head) + len(rest)
    assert fx.span_of(after).attributes["url.path"] == after.path
    fx.none_carry(fake)


def test_traceparent_name_split_across_reads_is_read(fx):
    s = new_sent("/split/tp")
    full = get_bytes(s)
    cut = full.index(b"traceparent") + 5
    c = Client(fx.go_port)
    c.send(full[:cut], full[cut:])
    assert c.response()[0] == 200
    c.close()
    span = fx.span_of(s)
    assert span.parent_span_id == s.parent_id


def test_chunked_request_body_is_framed_even_after_the_response(fx):
    """The server answers before reading the body and discards it afterwards (as Go does past
    256 KiB). The chunk data, a fake request arriving after the response, must not open a
    request; the next real request is traced."""
    post, fake, after = new_sent("/chunked/post"), new_sent("/chunked/fake"), new_sent("/c/after")
    data = get_bytes(fake)
    head = (
        f"POST {post.path} HTTP/1.1\r\nHost: t\r\n".encode()
        + tp_header(post)
        + b"Transfer-Encoding: chunked\r\n\r\n"
        + f"{len(data):x}\r\n".encode()
    )

    def handler(sock: socket.socket) -> None:
        r = Reader(sock)
        r.request()  # the head (no Content-Length: the chunked body stays unread)
        sock.sendall(ok())
        while b"\r\n0\r\n\r\n" not in r.buf:  # discard the body
            r.buf += sock.recv(65536)
        r.buf = r.buf.split(b"\r\n0\r\n\r\n", 1)[1]
        r.request()
        sock.sendall(ok(202))

    with Scripted(fx.port(), handler) as srv:
        c = Client(srv.lsock.getsockname()[1])
        c.send(head)
        assert c.response()[0] == 200
        c.send(data + b"\r\n0\r\n\r\n")
        assert c.request(get_bytes(after)) == 202
        c.close()
    assert fx.span_of(post).attributes["http.response.status_code"] == 200
    assert fx.span_of(after).attributes["http.response.status_code"] == 202
    fx.none_carry(fake)


def test_transfer_encoding_overrides_content_length(fx):
    """TE + CL: framed by TE (the chunk holds a fake request that CL framing would expose), and
    the connection is no longer trusted: the server must close after answering."""
    post, fake = new_sent("/tecl/post"), new_sent("/tecl/fake")
    data = get_bytes(fake)
    req = (
        f"POST {post.path} HTTP/1.1\r\nHost: t\r\n".encode()
        + tp_header(post)
        + b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
        + f"{len(data):x}\r\n".encode()
        + data
        + b"\r\n0\r\n\r\n"
    )
    before = fx.counters()
    with Scripted(fx.port(), serve_each(lambda s: s.sendall(ok()))) as srv:
        c = Client(srv.lsock.getsockname()[1])
        assert c.request(req) == 200
        c.close()
    assert fx.span_of(post).attributes["http.response.status_code"] == 200
    fx.none_carry(fake)
    assert delta(fx, before).get("untrusted_te_and_cl") == 1


@pytest.mark.parametrize(
    "lengths",
    [["5", "5"], ["5", "6"], ["5, 5"], ["1 0"], ["5x"], ["+5"], [""], ["5\r\n 0"]],
    ids=["duplicate", "conflicting", "list", "1 0", "5x", "+5", "empty", "obs-fold"],
)
def test_invalid_content_length_is_unframed_and_counted(fx, lengths):
    """The request is traced (with whatever the server answered), the body is never parsed,
    later bytes on the connection open nothing, and the connection is counted."""
    post, fake = new_sent("/cl/post"), new_sent("/cl/fake")
    body = get_bytes(fake)
    req = (
        f"POST {post.path} HTTP/1.1\r\nHost: t\r\n".encode()
        + tp_header(post)
        + b"".join(f"Content-Length: {v}\r\n".encode() for v in lengths)
        + b"\r\n"
        + body
    )
    before = fx.counters()
    c = Client(fx.go_port)
    c.send(req)
    status = c.response()[0]
    c.close()
    assert fx.span_of(post).attributes.get("http.response.status_code", 0) == status
    fx.none_carry(fake)
    assert delta(fx, before).get("untrusted_content_length") == 1


def test_early_response_stops_trusting_the_connection(fx):
    """The server answers before the request's headers end (as servers do for 431/400): we
    and it disagree about where that request ends. Nothing later on it becomes a request."""
    first, second = new_sent("/early/first"), new_sent("/early/second")

    def handler(sock: socket.socket) -> None:
        sock.recv(20)  # the request line, no more
        sock.sendall(ok(400))
        Reader(sock).request()
        time.sleep(0.3)

    before = fx.counters()
    with Scripted(fx.port(), handler) as srv:
        c = Client(srv.lsock.getsockname()[1])
        full = get_bytes(first)
        c.send(full[:20])
        assert c.response()[0] == 400
        c.send(full[20:] + get_bytes(second))
        time.sleep(0.2)
        c.close()
    [span] = fx.span_at(first.path)  # its traceparent came after the response: not read
    assert span.attributes["http.response.status_code"] == 400
    fx.none_carry(second)
    assert delta(fx, before).get("untrusted_early_response") == 1


def test_more_responses_than_requests_stops_trusting_the_connection(fx):
    """Two responses to one request: the second is credited to no one, and no later request
    on the connection is traced (it could only be credited a response that is not its own)."""
    first, second = new_sent("/extra/first"), new_sent("/extra/second")

    def twice(sock: socket.socket) -> None:
        sock.sendall(ok(201))
        sock.sendall(ok(202))

    before = fx.counters()
    with Scripted(fx.port(), serve_each(twice, lambda s: s.sendall(ok(203)))) as srv:
        c = Client(srv.lsock.getsockname()[1])
        assert c.request(get_bytes(first)) == 201
        assert c.response()[0] == 202
        assert c.request(get_bytes(second)) == 203
        c.close()
    assert fx.span_of(first).attributes["http.response.status_code"] == 201
    fx.none_carry(second)
    assert delta(fx, before).get("untrusted_response_without_request") == 1


def test_obs_fold_continues_the_traceparent_value(fx):
    """An obs-fold line continues the header before it (RFC 9112 5.2: read as a space): a
    traceparent with a continuation line is not the 55-byte value, so it is not adopted."""
    s = new_sent("/fold/tp")
    req = (
        f"GET {s.path} HTTP/1.1\r\nHost: t\r\n".encode()
        + tp_header(s)
        + b" -00f067aa0ba902b7-01\r\n\r\n"
    )
    with Scripted(fx.port(), serve_each(lambda k: k.sendall(ok()))) as srv:
        c = Client(srv.lsock.getsockname()[1])
        assert c.request(req) == 200
        c.close()
    [span] = fx.span_at(s.path)
    assert span.trace_id != s.trace_id
    assert span.attributes["tracejoin.traceparent.rejected"] == "too_long"


def test_bare_lf_line_endings(fx):
    """Bare LF ends lines in both directions, chunked bodies included (RFC 9112 2.2: a
    recipient may take a lone LF as a line end); keep-alive goes on after it."""
    first, second = new_sent("/lf/first"), new_sent("/lf/second")
    req = f"GET {first.path} HTTP/1.1\nHost: t\ntraceparent: {first.traceparent}\n\n".encode()
    bare = b"HTTP/1.1 201 Created\nTransfer-Encoding: chunked\nX-A: b\n\n5\nhello\n0\n\n"
    with Scripted(
        fx.port(), serve_each(lambda k: k.sendall(bare), lambda k: k.sendall(ok()))
    ) as srv:
        c = Client(srv.lsock.getsockname()[1])
        c.sock.sendall(req)
        while not c.buf.endswith(b"0\n\n"):
            c._fill()
        c.buf = b""
        assert c.request(get_bytes(second)) == 200
        c.close()
    span = fx.span_of(first)
    assert span.attributes["http.response.status_code"] == 201
    assert span.attributes["http.response.size"] == len(bare)
    assert fx.span_of(second).attributes["http.response.status_code"] == 200


def test_pipelined_beyond_the_limit_to_a_scripted_server_are_each_counted(fx):
    reqs = [new_sent(f"/pipe2/{i}") for i in range(20)]
    before = fx.counters()
    with Scripted(fx.port(), serve_each()) as srv:
        c = Client(srv.lsock.getsockname()[1])
        c.send(b"".join(get_bytes(s) for s in reqs))
        assert [c.response()[0] for _ in reqs] == [200] * 20
        c.close()
    spans = fx.spans_where(lambda s: str(s.attributes.get("url.path")).startswith("/pipe2/"), 8)
    assert sorted(s.attributes["url.path"] for s in spans) == sorted(s.path for s in reqs[:8])
    assert all(
        sp.trace_id == next(s for s in reqs if s.path == sp.attributes["url.path"]).trace_id
        for sp in spans
    )
    assert delta(fx, before).get("pipeline_slots_full") == 12


# ------------------------------------------------------------------------------ targets, methods


def test_absolute_form_target_keeps_only_the_path(fx):
    s = new_sent("/abs/x")
    req = (
        b"GET http://user:secretpw@internal.example:8080/abs/x?q=secretquery HTTP/1.1\r\n"
        b"Host: internal.example\r\n" + tp_header(s) + b"\r\n"
    )
    c = Client(fx.go_port)
    assert c.request(req) == 200
    c.close()
    span = fx.span_of(s)
    assert span.attributes["url.path"] == "/abs/x"
    text = repr(span.name) + repr(span.attributes)
    for secret in ("user", "secretpw", "internal.example", "8080", "secretquery", "http:"):
        assert secret not in text, secret


def test_path_parameters_are_not_copied(fx):
    """`;params` of path segments (`;jsessionid=` carries a session id) are dropped in the
    kernel; the segments around them stay."""
    s = new_sent("/app/x")
    req = (
        b"GET /app;jsessionid=SESSIONSECRET/x;v=2?q=1 HTTP/1.1\r\nHost: t\r\n"
        + tp_header(s)
        + b"\r\n"
    )
    c = Client(fx.go_port)
    assert c.request(req) == 200
    c.close()
    span = fx.span_of(s)
    assert span.attributes["url.path"] == "/app/x"
    assert "SESSIONSECRET" not in repr(span.name) + repr(span.attributes)


# The path is copied 8 bytes at a time where none of them ends it (bpf/http_request.h
# path_word): lengths around the word and the 96-byte cap, and each byte that ends the path or
# starts a parameter at every offset of a word, must give what byte-at-a-time copying gives.
PATH_CAP = 96


def _path_cases() -> list[tuple[str, str, bool]]:
    """(target sent, url.path expected, truncated)."""
    cases = []
    for n in (7, 8, 9, 15, 16, 17, 88, 89, 95, 96, 97, 104, 130):
        target = "/" + "".join(chr(ord("a") + i % 26) for i in range(n - 1))
        cases.append((target, target[:PATH_CAP], n > PATH_CAP))
    for stop in "?#;":
        for at in range(1, 10):
            head = "/" + "p" * (at - 1)
            target = head + stop + "tail/more"
            want = head + ("/more" if stop == ";" else "")
            cases.append((target, want, False))
    return cases


@pytest.mark.parametrize(("target", "want", "truncated"), _path_cases())
def test_path_copy_at_word_edges(fx, target, want, truncated):
    s = new_sent("/edge")
    req = f"GET {target} HTTP/1.1\r\nHost: t\r\n".encode() + tp_header(s) + b"\r\n"
    c = Client(fx.go_port)
    assert c.request(req) in (200, 404)
    c.close()
    span = fx.span_of(s)
    assert span.attributes["url.path"] == want
    assert span.attributes.get("tracejoin.http.path_truncated", False) is truncated


@pytest.mark.parametrize("pad", range(17))
def test_skipped_line_ends_at_every_offset_of_a_word(fx, pad):
    """A skipped header line is taken 8 bytes a step up to its LF (bpf/http_scan.h
    skip_line_word): with the LF at each offset of a word (a bare LF too), the next line's name
    is still read from its first byte, so the traceparent after it is found."""
    s = new_sent(f"/skip/{pad}")
    eol = "\n" if pad % 2 else "\r\n"
    req = (
        f"GET {s.path} HTTP/1.1\r\nHost: t\r\nX-Pad: {'a' * pad}{eol}".encode()
        + tp_header(s)
        + b"\r\n"
    )
    c = Client(fx.go_port)
    assert c.request(req) == 200
    c.close()
    assert fx.span_of(s).attributes["url.path"] == s.path


def test_methods_are_checked_whole(fx):
    """A method outside the known set is reported as _OTHER; bytes that are not a token never
    make a method (nor a request): `DELE\\x1bc` is not DELETE."""
    other, esc, after = new_sent("/m/propfind"), new_sent("/m/esc"), new_sent("/m/after")
    c = Client(fx.go_port)
    assert c.request(get_bytes(other).replace(b"GET ", b"PROPFIND ", 1)) == 200
    assert c.request(get_bytes(after)) == 200
    c.close()
    c = Client(fx.go_port)
    c.send(get_bytes(esc).replace(b"GET ", b"DELE\x1bc ", 1))
    assert c.response()[0] == 400
    c.close()
    span = fx.span_of(other)
    assert span.attributes["http.request.method"] == "_OTHER"
    assert fx.span_of(after).attributes["http.request.method"] == "GET"
    fx.none_carry(esc)
    for sp in fx.agent.spans():
        method = str(sp.attributes.get("http.request.method", ""))
        assert method.isprintable() and "\x1b" not in sp.name, sp


# ------------------------------------------------------------------------------ responses


def test_status_line_split_across_writes(fx):
    first, second = new_sent("/status/first"), new_sent("/status/second")

    def split(sock: socket.socket) -> None:
        for part in (b"HTTP/1.1 2", b"01 Created\r\nContent-Len", b"gth: 2\r\n\r\nok"):
            sock.sendall(part)
            time.sleep(0.01)

    with Scripted(fx.port(), serve_each(split, lambda k: k.sendall(ok(202)))) as srv:
        c = Client(srv.lsock.getsockname()[1])
        assert c.request(get_bytes(first)) == 201
        assert c.request(get_bytes(second)) == 202
        c.close()
    assert fx.span_of(first).attributes["http.response.status_code"] == 201
    assert fx.span_of(second).attributes["http.response.status_code"] == 202


def test_response_headers_beyond_the_window_in_one_write(fx):
    first, second = new_sent("/bighead/first"), new_sent("/bighead/second")
    big = b"HTTP/1.1 201 Created\r\nX-Big: " + b"a" * 6000 + b"\r\nContent-Length: 2\r\n\r\nok"
    with Scripted(
        fx.port(), serve_each(lambda k: k.sendall(big), lambda k: k.sendall(ok(202)))
    ) as srv:
        c = Client(srv.lsock.getsockname()[1])
        assert c.request(get_bytes(first)) == 201
        assert c.request(get_bytes(second)) == 202
        c.close()
    span = fx.span_of(first)
    assert span.attributes["http.response.status_code"] == 201
    assert span.attributes["http.response.size"] == len(big)
    assert fx.span_of(second).attributes["http.response.status_code"] == 202


def test_header_sections_of_thousands_of_steps(fx):
    """Header sections of ~600 short lines, each byte a scanner step: the scan goes on across
    bpf_loop callbacks (LOOP_STEPS steps each), tail calls (SCAN_CHUNK steps each) and a window
    reload, and frames both messages whole. The traceparent is met after several callbacks."""
    s, after = new_sent("/manylines/first"), new_sent("/manylines/after")
    lines = b"".join(b"x%d:y\r\n" % i for i in range(600))
    before = b"".join(b"w%d:y\r\n" % i for i in range(60))  # ~60 x 7 steps
    req = get_bytes(s, extra=lines).replace(b"traceparent", before + b"traceparent", 1)
    body = b"done"
    resp = b"HTTP/1.1 203 X\r\n" + lines + b"Content-Length: %d\r\n\r\n" % len(body) + body
    with Scripted(fx.port(), serve_each(lambda k: k.sendall(resp))) as srv:
        c = Client(srv.lsock.getsockname()[1])
        assert c.request(req) == 203
        assert c.request(get_bytes(after)) == 200
        c.close()
    span = fx.span_of(s)
    assert span.trace_id == s.trace_id and span.parent_span_id == s.parent_id
    assert span.attributes["http.request.size"] == len(req)
    assert span.attributes["http.response.status_code"] == 203
    assert span.attributes["http.response.size"] == len(resp)
    assert fx.span_of(after).attributes["http.response.status_code"] == 200


CHUNKED_HEAD = b"HTTP/1.1 201 Created\r\nTransfer-Encoding: chunked\r\n\r\n"


def writev_later_iovec(k: socket.socket) -> None:
    """the terminator in a later iovec of one writev (as Node writes)"""
    os.writev(k.fileno(), [CHUNKED_HEAD, b"5\r\n", b"hello", b"\r\n", b"0\r\n\r\n"])


def past_the_window(k: socket.socket) -> None:
    """one write, the terminator past the first 4 KiB"""
    k.sendall(CHUNKED_HEAD + b"1770\r\n" + b"x" * 0x1770 + b"\r\n0\r\n\r\n")


def sizes_past_the_window(k: socket.socket) -> None:
    """many chunks in one write, their size lines past the first 4 KiB"""
    chunks = b"".join(b"ff\r\n" + b"y" * 255 + b"\r\n" for _ in range(40))
    k.sendall(CHUNKED_HEAD + chunks + b"0\r\n\r\n")


def own_write(k: socket.socket) -> None:
    """the terminator alone in its own write"""
    k.sendall(CHUNKED_HEAD + b"5\r\nhello\r\n")
    time.sleep(0.01)
    k.sendall(b"0\r\n\r\n")


def sendmsg_per_chunk(k: socket.socket) -> None:
    """sendmsg with the size line, data and CRLF as separate buffers, chunk by chunk"""
    k.sendmsg([CHUNKED_HEAD])
    for _ in range(30):
        k.sendmsg([b"3\r\n", b"abc", b"\r\n"])
    k.sendmsg([b"0\r\n", b"\r\n"])


@pytest.mark.parametrize(
    "write",
    [writev_later_iovec, past_the_window, sizes_past_the_window, own_write, sendmsg_per_chunk],
)
def test_chunked_response_end_wherever_it_is_written(fx, write):
    first, second = new_sent("/chunked/first"), new_sent("/chunked/second")
    with Scripted(fx.port(), serve_each(write, lambda k: k.sendall(ok(202)))) as srv:
        c = Client(srv.lsock.getsockname()[1])
        c.sock.sendall(get_bytes(first))
        status, resp = c.response()
        assert status == 201
        assert c.request(get_bytes(second)) == 202
        c.close()
    span = fx.span_of(first)
    assert span.attributes["http.response.status_code"] == 201
    assert span.attributes["http.response.size"] == len(resp)
    assert "tracejoin.http.response_unframed" not in span.attributes
    assert fx.span_of(second).attributes["http.response.status_code"] == 202


@pytest.mark.parametrize(
    ("which", "path"),
    [
        ("node", "/chunks?n=40"),
        ("node", "/drip?n=5"),
        ("go", "/chunks?n=20"),
        ("py", "/chunks?n=20"),
    ],
    ids=["node-corked-writev", "node-writev-per-chunk", "go-flush", "python-writes"],
)
def test_real_servers_chunked_responses(fx, which, path):
    port = {"node": fx.node_port, "go": fx.go_port, "py": fx.py_port}[which]
    first, second = new_sent(f"/real/{which}/first"), new_sent(f"/real/{which}/second")
    c = Client(port)
    c.sock.sendall(get_bytes(first).replace(first.path.encode(), path.encode(), 1))
    status, resp = c.response()
    assert status == 200 and resp.endswith(b"0\r\n\r\n"), resp[-20:]
    assert c.request(get_bytes(second)) == 200
    c.close()
    span = fx.span_of(first)
    assert span.attributes["url.path"] == path.split("?")[0]
    assert span.attributes["http.response.size"] == len(resp)
    assert "tracejoin.http.response_unframed" not in span.attributes
    assert fx.span_of(second).attributes["url.path"] == second.path


def test_http10_close_delimited_response(fx):
    s = new_sent("/http10")
    parts = [b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n", b"part one ", b"part two"]

    def handler(sock: socket.socket) -> None:
        Reader(sock).request()
        for p in parts:
            sock.sendall(p)
            time.sleep(0.02)

    with Scripted(fx.port(), handler) as srv:
        c = Client(srv.lsock.getsockname()[1])
        c.sock.sendall(get_bytes(s))
        status, resp = c.response()
        c.close()
    assert status == 200 and resp == b"".join(parts)
    span = fx.span_of(s)
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["http.response.size"] == len(resp)
    assert span.attributes["tracejoin.http.response_unframed"] is True


def test_head_and_interim_responses_keep_the_connection_in_step(fx):
    """HEAD's response has no body whatever its Content-Length says; a 100 Continue is followed
    by the final response of the same request (regression guards for the parser rewrite)."""
    head, post, after = new_sent("/head"), new_sent("/continue"), new_sent("/after-head")
    go = Client(fx.go_port)
    assert go.request(get_bytes(head).replace(b"GET ", b"HEAD ", 1), to_head=True) == 200
    assert go.request(get_bytes(after)) == 200
    go.close()
    assert fx.span_of(head).attributes["http.request.method"] == "HEAD"
    assert fx.span_of(after).attributes["http.response.status_code"] == 200

    def cont(k: socket.socket) -> None:
        k.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        time.sleep(0.01)
        k.sendall(ok(201))

    second = new_sent("/after-continue")
    with Scripted(fx.port(), serve_each(cont, lambda k: k.sendall(ok(202)))) as srv:
        c = Client(srv.lsock.getsockname()[1])
        c.sock.sendall(get_bytes(post))
        assert c.response()[0] == 100
        assert c.response()[0] == 201
        assert c.request(get_bytes(second)) == 202
        c.close()
    assert fx.span_of(post).attributes["http.response.status_code"] == 201
    assert fx.span_of(second).attributes["http.response.status_code"] == 202
