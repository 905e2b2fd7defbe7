/* Helpers shared by the request and response scanners. Part of the bpf/http.c compile unit.
 *
 * Scanners run as tail-called programs over the per-CPU scratch copy of one read or write,
 * SCAN_CHUNK bytes per program, so the verifier sees small bounded loops.
 */

static __always_inline u8 lc(u8 ch)
{
    return (ch >= 'A' && ch <= 'Z') ? ch + 32 : ch;
}

#define BYTE(i) (s->buf[(i) & (SCRATCH_SIZE - 1)])

/* Case-insensitive match of a lowercase header name plus ':' at offset i (fully inside buf). */
static __always_inline int hdr_is(struct scratch *s, u32 i, const char *name, u32 len)
{
    if (i + len + 1 > s->n)
        return 0;
#pragma unroll
    for (u32 k = 0; k < 18; k++) {
        if (k >= len)
            break;
        if (lc(BYTE(i + k)) != (u8)name[k])
            return 0;
    }
    return BYTE(i + len) == ':';
}

/* Scanner steps keep their position and state in map memory, re-read every step (VLD), so the
 * verifier sees the same abstract state at every loop head and prunes: a few hundred
 * instructions per step instead of a state per (state, offset) pair. */
#define VLD(x) (*(volatile typeof(x) *)&(x))
enum { STEP_GO, STEP_STOP, STEP_NEXT };

/* Skip up to *left bytes of a framed body; true when the body is complete. */
static __always_inline int skip_body(struct scratch *s, u32 i, u64 *left, u64 *counted)
{
    u64 avail = s->total - i, body = *left;
    u64 skip = body < avail ? body : avail;
    *counted += skip;
    s->off = i + skip;
    *left = body - skip;
    return body == skip;
}

/* One byte of a Content-Length value: accumulate digits; returns the next parser state
 * (`same` while in the value, `line_start` at LF, `skip_line` on anything else). */
static __always_inline u8 cl_byte(u64 *cl, u8 ch, u8 same, u8 line_start, u8 skip_line)
{
    if (ch >= '0' && ch <= '9') {
        if (*cl < CL_MAX)
            *cl = *cl * 10 + (ch - '0');
        return same;
    }
    if (ch == '\n')
        return line_start;
    return (ch == ' ' || ch == '\t') ? same : skip_line;
}
