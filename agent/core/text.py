"""Client-controlled bytes -> text that is safe to store, show and print.

Any HTTP client chooses the method and path bytes the kernel copies. They end up in span names,
attributes, the capture summary and terminals run by root, so they are normalised here, once,
before they become strings (docs/attributes.md, docs/capture.md):

- `http_method`: the OTel `http.request.method` value (a known method, or `_OTHER`) and the
  `http.request.method_original` value (only when the original is a valid RFC 9110 token).
- `url_path`: the path with control characters, bidi/line-separator controls and invalid UTF-8
  percent-encoded, and every `%` left unambiguous, so the value holds no control character and
  percent-decodes to the bytes the server was sent.
- `terminal_safe`: any text, with every character a terminal would act on (C0, DEL, C1, ESC in
  particular) or lay out differently (bidi, line separators) written as a visible escape.
"""

from __future__ import annotations

import re
from functools import lru_cache

# OTel HTTP semantic conventions: the methods of RFC 9110, PATCH (RFC 5789) and QUERY, compared
# exactly (method names are case-sensitive: "get" is not GET).
KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "QUERY"}
)
OTHER_METHOD = "_OTHER"
# RFC 9110 sets no limit; the longest registered method (UPDATEREDIRECTREF) has 17 characters.
METHOD_ORIGINAL_MAX = 32
# RFC 9110 section 5.6.2: token = 1*tchar.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")

# Characters that a terminal acts on or that change how the text after them is laid out:
# C0 controls, DEL and C1 controls (ESC, CSI U+009B, OSC U+009D, ... start terminal commands;
# CR and LF forge lines); the bidi controls (U+061C, U+200E-F, U+202A-E, U+2066-9) that reorder
# what follows; the line and paragraph separators (U+2028-9); and lone surrogates, which no UTF-8
# stream can carry (printing one raises UnicodeEncodeError).
_CONTROLS = r"\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
_UNSAFE = re.compile(rf"[{_CONTROLS}\ud800-\udfff]")

# In a path: the space too (< 0x21), the controls, and the bytes that were not valid UTF-8
# (decoded by surrogateescape to U+DC80-U+DCFF). Then a `%` that does not start a %XX escape.
_PATH_CONTROL = re.compile(rf"[\x20{_CONTROLS}\udc80-\udcff]")
_LONE_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")
_PRINTABLE_ASCII = bytes(range(0x21, 0x7F))


_KNOWN = {m.encode(): (m, None) for m in KNOWN_METHODS}


@lru_cache(maxsize=256)  # per record on the hot path; a few methods repeat
def http_method(raw: bytes) -> tuple[str, str | None]:
    """(http.request.method, http.request.method_original or None) for the method bytes.

    A known method is itself, with no original. Anything else is `_OTHER`; the original is kept
    only when it is a token of at most METHOD_ORIGINAL_MAX characters, so it can never carry a
    control byte, a space or non-ASCII text into an attribute."""
    known = _KNOWN.get(raw)
    if known is not None:
        return known
    if len(raw) <= METHOD_ORIGINAL_MAX and _TOKEN.fullmatch(raw):
        return OTHER_METHOD, raw.decode("ascii")
    return OTHER_METHOD, None


def _percent(m: re.Match[str]) -> str:
    ch = m.group()
    if "\udc80" <= ch <= "\udcff":  # an invalid UTF-8 byte, as surrogateescape decoded it
        return f"%{ord(ch) - 0xDC00:02X}"
    return "".join(f"%{b:02X}" for b in ch.encode())


@lru_cache(maxsize=4096)  # per record on the hot path; paths repeat (bounded: hostile ones)
def url_path(raw: bytes) -> str:
    """The url.path value for the path bytes of a request line.

    Valid UTF-8 stays readable (`/café`), and a path that is already a valid percent-encoded
    one (`/a%20b`) comes back unchanged: no double encoding. Percent-encoded (%XX, uppercase):
    bytes < 0x21, 0x7f, every byte of an invalid UTF-8 sequence, the UTF-8 bytes of a C1 control,
    bidi control or line separator, and a `%` not followed by two hex digits (`/100%` ->
    `/100%25`: RFC 3986 writes a literal `%` as `%25`). So every `%` in the result starts an
    escape, and percent-decoding the result gives exactly what percent-decoding the wire bytes
    gives (a `%` that starts no escape decoding to itself): a raw ESC on the wire and a `%1B` on
    the wire are the same path to a server, and the same here."""
    if raw.translate(None, _PRINTABLE_ASCII):  # at C speed: usually printable ASCII only
        path = _PATH_CONTROL.sub(_percent, raw.decode("utf-8", "surrogateescape"))
    else:
        path = raw.decode("ascii")
    # Last, so the escapes added above (all valid) are left alone.
    return _LONE_PERCENT.sub("%25", path) if "%" in path else path


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x80 else f"\\u{c:04x}"


def terminal_safe(s: str) -> str:
    """`s` with every unsafe character (see _UNSAFE) written as a visible escape: `\\x1b` for
    C0 and DEL, `\\u009b` for C1 and the rest. Tab and newline are escaped too: a line printed
    stays one line. Other text, backslashes included, is unchanged (for reading, not parsing)."""
    if s.isprintable():  # the common case, at C speed: no control, separator or surrogate
        return s
    return _UNSAFE.sub(_escape, s)
