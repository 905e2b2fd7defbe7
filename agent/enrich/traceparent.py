"""W3C Trace Context `traceparent` validation (rules: shared/TRACEPARENT.md).

The kernel hands us at most the first 56 bytes of the header value (the 55-byte version-00 form
plus the byte after it) and the value's full length, so the parser takes a prefix and a length.
It never raises: every input maps to a context or to one rejection reason, and reasons are
counted by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

VALUE_LEN = 55  # "00-" + 32 + "-" + 16 + "-" + 2
_HEX = frozenset(b"0123456789abcdef")
_UPPER_HEX = frozenset(b"ABCDEF")
_HEX_OR_DASH = b"0123456789abcdef-"

# Rejection reasons, exported as the `reason` label of the rejection counter.
DUPLICATE = "duplicate"
TRUNCATED = "truncated"
TOO_LONG = "too_long"
BAD_VERSION = "bad_version"
UPPERCASE = "uppercase"
MALFORMED = "malformed"
ZERO_TRACE_ID = "zero_trace_id"
ZERO_PARENT_ID = "zero_parent_id"
BEYOND_SCAN_WINDOW = "beyond_scan_window"
REASONS = (
    DUPLICATE,
    TRUNCATED,
    TOO_LONG,
    BAD_VERSION,
    UPPERCASE,
    MALFORMED,
    ZERO_TRACE_ID,
    ZERO_PARENT_ID,
    BEYOND_SCAN_WINDOW,
)


@dataclass(frozen=True, slots=True)
class TraceParent:
    trace_id: int
    parent_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 0x01)


def _hexfield(raw: bytes) -> int | str:
    """Parse lowercase hex, or return the rejection reason."""
    if not raw.translate(None, b"0123456789abcdef"):  # one C call, not a byte-wise generator
        return int(raw, 16)
    if all(c in _HEX or c in _UPPER_HEX for c in raw):
        return UPPERCASE
    return MALFORMED


def parse(value: bytes, total_len: int | None = None) -> TraceParent | str:
    """Validate one traceparent value (surrounding whitespace already removed).

    `value` may be a prefix of the real value; `total_len` is the real length. Returns a
    TraceParent, or the rejection reason (a member of REASONS).
    """
    n = len(value) if total_len is None else total_len
    # The common case first, in a few C calls: a version-00 value of lowercase hex with its
    # three dashes in place and non-zero ids. Anything else takes the rules below, which also
    # name the reason.
    if (
        n == VALUE_LEN
        and value[:3] == b"00-"
        and value[35:36] == b"-"
        and value[52:53] == b"-"
        and value.count(b"-") == 3
        and not value.translate(None, _HEX_OR_DASH)
    ):
        trace_id, parent_id = int(value[3:35], 16), int(value[36:52], 16)
        if trace_id and parent_id:
            return TraceParent(trace_id, parent_id, int(value[53:55], 16))
    if n < VALUE_LEN or len(value) < VALUE_LEN:
        return TRUNCATED
    if value[2:3] != b"-" or value[35:36] != b"-" or value[52:53] != b"-":
        return MALFORMED
    version = _hexfield(value[0:2])
    if isinstance(version, str):
        return version
    if version == 0xFF:
        return BAD_VERSION
    if version == 0 and n != VALUE_LEN:
        return TOO_LONG
    # A future version may append fields, but only after a '-'.
    if version != 0 and n > VALUE_LEN and value[55:56] != b"-":
        return MALFORMED
    fields = []
    for raw in (value[3:35], value[36:52], value[53:55]):
        parsed = _hexfield(raw)
        if isinstance(parsed, str):
            return parsed
        fields.append(parsed)
    trace_id, parent_id, flags = fields
    if trace_id == 0:
        return ZERO_TRACE_ID
    if parent_id == 0:
        return ZERO_PARENT_ID
    return TraceParent(trace_id, parent_id, flags)


def parse_header_values(values: list[bytes]) -> TraceParent | str | None:
    """Apply the header-level rules to all `traceparent` values of one request.

    None means no header at all; more than one header is invalid.
    """
    if not values:
        return None
    if len(values) > 1:
        return DUPLICATE
    return parse(values[0].strip(b" \t"))
