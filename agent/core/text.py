"""Text that is safe to print to a terminal (minimal version; see the lead's reconciliation)."""

from __future__ import annotations

# C0 controls and DEL as \xNN, C1 controls as \u00NN: no escape sequence, bell or cursor
# movement from span text (which an HTTP client chooses) ever reaches the operator's terminal.
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)} | {
    c: f"\\u{c:04x}" for c in range(0x80, 0xA0)
}


def terminal_safe(s: str) -> str:
    """`s` with every C0 control (< 0x20), DEL (0x7f) and C1 control (U+0080..U+009F) escaped."""
    return s.translate(_ESCAPES)
