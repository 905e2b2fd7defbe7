"""What a served process says about itself: its OpenTelemetry process context (OTEP 4719) and,
opt-in, the two OpenTelemetry variables of its environment (docs/attributes.md, "service.name").

Process context. An SDK that implements OTEP 4719 publishes its resource in a mapping named
OTEL_CTX: `[anon:OTEL_CTX]` (an anonymous mapping named with prctl(PR_SET_VMA_ANON_NAME)),
`[anon_shmem:OTEL_CTX]` or `/memfd:OTEL_CTX` in /proc/<pid>/maps. The mapping starts with a
32-byte header, in the publisher's byte order:

    char     signature[8]      "OTEL_CTX", written last by the publisher
    uint32   version           2
    uint32   payload_size      bytes of the payload
    uint64   published_at_ns   0 while the publisher updates the payload
    uint64   payload           address, in the publisher, of an
                               opentelemetry.proto.resource.v1.Resource (protobuf)

The reader reads the header, the payload, then the header again: a changed `published_at_ns`
means the publisher updated it meanwhile, and the read is retried. Reading another process's
maps and memory needs ptrace-read access (CAP_SYS_PTRACE for another user's process).

Environment (`--read-environ`). /proc/<pid>/environ holds the environment the process was
started with, secrets included: only OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are taken
from it, as the OpenTelemetry SDK would read them; every other byte is dropped unread and never
logged. A variable the process changed after exec is not seen.

Everything read is the served process's choice, so hostile: keys outside [A-Za-z0-9._-] are
dropped, string values are made terminal-safe and cut at MAX_VALUE characters, at most MAX_ATTRS
attributes are kept, and keys that tracejoin measures itself (process.*, host.*, k8s.*, ...)
are never taken from the process.
"""

from __future__ import annotations

import math
import os
import re
import struct
import urllib.parse
from collections.abc import Iterable

from google.protobuf.message import DecodeError
from opentelemetry.proto.resource.v1.resource_pb2 import Resource as ResourceProto
from tracejoin.core.model import AttrValue
from tracejoin.core.text import terminal_safe

SIGNATURE = b"OTEL_CTX"
VERSION = 2
HEADER = struct.Struct("=8sIIQQ")  # signature, version, payload_size, published_at_ns, payload
MAPPING_NAMES = frozenset({"[anon:OTEL_CTX]", "[anon_shmem:OTEL_CTX]", "/memfd:OTEL_CTX"})
MAX_PAYLOAD = 64 * 1024  # a resource is a few hundred bytes; a bigger claim is not read
READ_ATTEMPTS = 3  # header-payload-header reads before a context being rewritten is given up

MAX_ATTRS = 32
MAX_KEY = 128
MAX_VALUE = 256  # characters, after control characters are escaped
MAX_ENVIRON = 1 << 20  # bytes of /proc/<pid>/environ read; variables beyond it are not seen
MAX_RESOURCE_ATTRIBUTES = 8 * 1024  # bytes of an OTEL_RESOURCE_ATTRIBUTES value parsed

SERVICE_NAME_VAR = b"OTEL_SERVICE_NAME="
RESOURCE_ATTRIBUTES_VAR = b"OTEL_RESOURCE_ATTRIBUTES="

_KEY = re.compile(rf"[A-Za-z0-9._-]{{1,{MAX_KEY}}}")
# What tracejoin measures or detects itself: the process can never relabel it.
PROTECTED_PREFIXES = ("process.", "host.", "container.", "k8s.", "telemetry.", "tracejoin.")

INVALID_REASONS = ("signature", "version", "size", "torn", "decode")


class InvalidContext(Exception):
    """The OTEL_CTX mapping is there but does not hold a context (reason: INVALID_REASONS)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def clean_attributes(pairs: Iterable[tuple[str, object]]) -> dict[str, AttrValue]:
    """The attributes a process declares, as tracejoin can safely put on spans: well-formed
    keys not tracejoin's own, str/bool/int/float values (strings terminal-safe and bounded),
    at most MAX_ATTRS of them; an empty string value is dropped."""
    out: dict[str, AttrValue] = {}
    for key, value in pairs:
        if len(out) >= MAX_ATTRS:
            break
        if not _KEY.fullmatch(key) or key.startswith(PROTECTED_PREFIXES):
            continue
        if isinstance(value, str):
            text = terminal_safe(value.strip())[:MAX_VALUE]
            if text:
                out[key] = text
        elif isinstance(value, bool | int) or (isinstance(value, float) and math.isfinite(value)):
            out[key] = value
    return out


# --------------------------------------------------------------------------- process context


def find_mapping(maps_text: str) -> int | None:
    """Start address of the OTEL_CTX mapping in a /proc/<pid>/maps text; None without one."""
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        name = fields[5].strip().removesuffix(" (deleted)")
        if name in MAPPING_NAMES:
            return int(fields[0].split("-", 1)[0], 16)
    return None


def decode_resource(payload: bytes) -> dict[str, AttrValue]:
    """The attributes of a protobuf Resource, cleaned (InvalidContext("decode") if it is not
    one). Values other than string, bool, int and double (arrays, maps, bytes) are skipped."""
    try:
        msg = ResourceProto.FromString(payload)
    except DecodeError:
        raise InvalidContext("decode") from None
    pairs: list[tuple[str, object]] = []
    for kv in msg.attributes:
        which = kv.value.WhichOneof("value")
        if which in ("string_value", "bool_value", "int_value", "double_value"):
            pairs.append((kv.key, getattr(kv.value, which)))
    return clean_attributes(pairs)


def read_process_context(pid: int, proc: str = "/proc") -> dict[str, AttrValue] | None:
    """The resource pid published (OTEP 4719), cleaned; None when it published none.
    OSError when its maps or memory cannot be read (EACCES/EPERM: no ptrace-read access;
    ENOENT/ESRCH: gone); InvalidContext when the mapping holds no valid context."""
    with open(f"{proc}/{pid}/maps") as f:
        start = find_mapping(f.read())
    if start is None:
        return None
    fd = os.open(f"{proc}/{pid}/mem", os.O_RDONLY)
    try:
        for _ in range(READ_ATTEMPTS):
            sig, version, size, published, addr = HEADER.unpack(_pread(fd, HEADER.size, start))
            if sig != SIGNATURE:
                raise InvalidContext("signature")
            if version != VERSION:
                raise InvalidContext("version")
            if not 0 < size <= MAX_PAYLOAD or addr == 0:
                raise InvalidContext("size")
            if published == 0:
                continue  # the publisher is updating it
            payload = _pread(fd, size, addr)
            if HEADER.unpack(_pread(fd, HEADER.size, start))[3] == published:
                return decode_resource(payload)
        raise InvalidContext("torn")
    finally:
        os.close(fd)


def _pread(fd: int, n: int, addr: int) -> bytes:
    try:
        data = os.pread(fd, n, addr)
    except OverflowError:  # an address beyond off_t: not one the process can have mapped
        raise InvalidContext("size") from None
    except OSError as exc:  # EIO: the address is not mapped in the process
        if exc.errno == 5:
            raise InvalidContext("size") from None
        raise
    if len(data) != n:
        raise InvalidContext("size")
    return data


# --------------------------------------------------------------------------- environment


def read_otel_environ(pid: int, proc: str = "/proc") -> dict[str, AttrValue] | None:
    """service.name and the resource attributes pid's environment sets through
    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES, cleaned; None when it sets neither.
    OSError when the environment cannot be read (EACCES: no ptrace-read access)."""
    with open(f"{proc}/{pid}/environ", "rb") as f:
        data = f.read(MAX_ENVIRON)
    return parse_otel_environ(data)


def parse_otel_environ(data: bytes) -> dict[str, AttrValue] | None:
    """The same, from the bytes of an environ file. Only the two variables' values are kept."""
    service: bytes | None = None
    resource: bytes | None = None
    for entry in data.split(b"\0"):
        if entry.startswith(SERVICE_NAME_VAR):
            service = entry[len(SERVICE_NAME_VAR) :]
        elif entry.startswith(RESOURCE_ATTRIBUTES_VAR):
            resource = entry[len(RESOURCE_ATTRIBUTES_VAR) :]
    if service is None and resource is None:
        return None
    pairs: list[tuple[str, object]] = []
    if resource:
        pairs.extend(_resource_attributes(resource[:MAX_RESOURCE_ATTRIBUTES]))
    attrs = clean_attributes(pairs)
    # the SDK's rule: OTEL_SERVICE_NAME wins over a service.name in OTEL_RESOURCE_ATTRIBUTES
    if service is not None:
        name = clean_attributes([("service.name", _text(service[: MAX_VALUE * 4]))])
        if name:
            attrs.pop("service.name", None)
            attrs = {"service.name": name["service.name"], **attrs}
    return attrs


def _resource_attributes(raw: bytes) -> Iterable[tuple[str, object]]:
    """key=value pairs, comma-separated, values percent-decoded (the SDK's reading)."""
    for item in _text(raw).split(","):
        key, sep, value = item.partition("=")
        if sep:
            yield key.strip(), urllib.parse.unquote(value.strip())


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "backslashreplace")
