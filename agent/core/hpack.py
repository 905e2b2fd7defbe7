"""HPACK Huffman coding (RFC 7541 section 5.2, Appendix B), for the HTTP/2 values the kernel
copies as they were sent: traceparent, :path and :method (bpf/http2_scan.h).

Ground floor: pure, imports nothing of ours. The code is canonical (codes assigned in order of
length, then symbol), so the 257 code lengths of Appendix B define it; the codes are rebuilt
from them at import. Decoding walks the code tree a byte at a time through a memoised
(state, byte) table, so a value costs one dict lookup per byte once the table is warm.
"""

from __future__ import annotations

# Appendix B: the code length in bits of symbols 0-255 and EOS (256).
# fmt: off
_LENGTHS: tuple[int, ...] = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28,
    28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 28,
    6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6,
    5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7, 8, 15, 6, 12, 10,
    13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7,
    7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19, 13, 14, 6,
    15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5,
    6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13, 28,
    20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23,
    24, 24, 22, 23, 24, 23, 23, 23, 23, 21, 22, 23, 22, 23, 23, 24,
    22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23,
    21, 21, 22, 21, 23, 22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23,
    26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27,
    20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25, 25, 24, 24, 26, 23,
    26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26,
    30,
)
# fmt: on
EOS = 256


def _canonical_codes(lengths: tuple[int, ...]) -> list[int]:
    codes = [0] * len(lengths)
    code, prev = 0, 0
    for i, sym in enumerate(sorted(range(len(lengths)), key=lambda s: (lengths[s], s))):
        n = lengths[sym]
        if i:
            code = (code + 1) << (n - prev)
        codes[sym], prev = code, n
    return codes


CODES: tuple[int, ...] = tuple(_canonical_codes(_LENGTHS))

# The code tree: node 0 is the root; _child[node][bit] is a node, or -1 - symbol at a leaf.
_child: list[list[int]] = [[0, 0]]
for _sym, (_code, _n) in enumerate(zip(CODES, _LENGTHS, strict=True)):
    _node = 0
    for _k in range(_n - 1, -1, -1):
        _bit = (_code >> _k) & 1
        if _k == 0:
            _child[_node][_bit] = -1 - _sym
        else:
            if _child[_node][_bit] == 0:
                _child.append([0, 0])
                _child[_node][_bit] = len(_child) - 1
            _node = _child[_node][_bit]

# Nodes reached from the root by 0 to 7 one-bits: where valid EOS padding may stop.
_pad_nodes = {0}
_node = 0
for _ in range(7):
    _node = _child[_node][1]
    _pad_nodes.add(_node)
_PADDING_END = frozenset(_pad_nodes)

# (state << 8 | byte) -> (next state, decoded bytes), or None where the byte holds EOS.
_step_cache: dict[int, tuple[int, bytes] | None] = {}


def _step(state: int, byte: int) -> tuple[int, bytes] | None:
    out = bytearray()
    for k in range(7, -1, -1):
        nxt = _child[state][(byte >> k) & 1]
        if nxt < 0:
            sym = -1 - nxt
            if sym == EOS:
                return None
            out.append(sym)
            state = 0
        else:
            state = nxt
    return state, bytes(out)


def huffman_decode(data: bytes, *, partial: bool = False) -> bytes | None:
    """The decoded string; None when `data` is not a valid Huffman-coded string (EOS inside,
    padding longer than 7 bits or not all ones). `partial`: data is a prefix cut anywhere (the
    kernel copied only its first bytes): the symbols it completes are returned."""
    state = 0
    out = bytearray()
    cache = _step_cache
    for byte in data:
        key = state << 8 | byte
        if key not in cache:
            cache[key] = _step(state, byte)
        hit = cache[key]
        if hit is None:
            return None
        state, got = hit
        out += got
    if not partial and state not in _PADDING_END:
        return None
    return bytes(out)


def huffman_encode(data: bytes) -> bytes:
    """`data` Huffman-coded, padded with the most significant bits of EOS (all ones)."""
    acc, nbits = 0, 0
    for b in data:
        acc = acc << _LENGTHS[b] | CODES[b]
        nbits += _LENGTHS[b]
    pad = -nbits % 8
    acc = acc << pad | ((1 << pad) - 1)
    return acc.to_bytes((nbits + pad) // 8, "big")
