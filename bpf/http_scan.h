/* What both scanners share: the window over the bytes of one read or write, and the parts of an
 * HTTP/1.1 message that look the same in both directions (header names, Content-Length,
 * Transfer-Encoding, chunked bodies), framed as RFC 9112 section 6 says a recipient must.
 * Part of the bpf/http.c compile unit.
 *
 * Scanners run as tail-called programs over the per-CPU scratch, SCAN_CHUNK steps per program,
 * so the verifier sees small bounded loops. Bytes a state must look at have to be inside the
 * current window; when they are not, the step asks for a reload (STEP_RELOAD) and the next
 * program copies the window that holds them, from the buffer or from whichever iovec of a
 * readv/writev/recvmsg/sendmsg they are in. Body bytes are skipped by count and never copied.
 */

/* Scanner steps keep their position and state in map memory, re-read every step (VLD), so the
 * verifier sees the same abstract state at every loop head and prunes: a few hundred
 * instructions per step instead of a state per (state, offset) pair. */
#define VLD(x) (*(volatile typeof(x) *)&(x))
enum { STEP_GO, STEP_STOP, STEP_NEXT, STEP_RELOAD, STEP_HDR_END, STEP_BAD };

#define BYTE(i) (s->buf[((i) - s->base) & (2 * SCRATCH_SIZE - 1)])

/* What a scanner hands its bpf_loop callback (scan_req_steps, scan_resp_steps), on its stack */
struct scan_loop {
    struct scratch *s;
    struct conn *c;
    struct http_record *rec;
};

static __always_inline int visible(struct scratch *s, u32 i)
{
    return i - s->base < s->n;
}

/* The 8 bytes at i, little-endian, into *w: false when they are not all in the window. */
static __always_inline int word_at(struct scratch *s, u32 i, u64 *w)
{
    u32 at = i - s->base;
    if (at + 8 > s->n)
        return 0;
    *w = *(u64 *)&s->buf[at & (SCRATCH_SIZE - 1)];
    return 1;
}

/* Nonzero when some byte of x is ch: the classic has-zero-byte test on x ^ ch..ch, exact about
 * whether (not which). The fast paths below test a word for the bytes that would end what they
 * copy or skip, and take it whole when none is there, instead of eight one-byte steps. */
static __always_inline u64 has_byte(u64 x, u8 ch)
{
    u64 y = x ^ (0x0101010101010101ULL * ch);
    return (y - 0x0101010101010101ULL) & ~y & 0x8080808080808080ULL;
}

/* A line being skipped (P_LINE_REST, P_SKIP_LINE), 8 bytes per step: all 8 when none is '\n',
 * else up to and including the first '\n', where the next line starts (P_LINE_START), as the
 * one-byte steps would. Returns the bytes taken, or -1 when fewer than 8 are in the window. */
static __always_inline int skip_line_word(struct scratch *s, struct hparse *p, u32 i)
{
    u64 x;
    if (!word_at(s, i, &x))
        return -1;
    u64 lf = has_byte(x, '\n');
    if (!lf)
        return 8;
    /* has_byte flags no byte below the first match, so the lowest flag is the first '\n':
     * 0x80 << 8k for the k-th byte, and k is how many byte boundaries lie below it */
    u64 low = lf & -lf;
    int k = (low > 0xffULL) + (low > 0xffffULL) + (low > 0xffffffULL) + (low > 0xffffffffULL) +
            (low > 0xffffffffffULL) + (low > 0xffffffffffffULL) + (low > 0xffffffffffffffULL);
    p->state = P_LINE_START;
    return k + 1;
}

/* States that skip bytes by count and never look at them: no window needed. */
static __always_inline int skipping(u8 st)
{
    return st == P_BODY || st == P_CHUNK_DATA || st == P_OPAQUE || st == P_DEAD;
}

/* Copy the window that starts at s->off: up to SCRATCH_SIZE bytes, gathered across as many
 * iovecs as IOV_WALK steps reach (Node writes each chunk of a chunked body as three small
 * iovecs of one writev). Leaves n == 0 when no byte there can be read; returns true when the
 * walk stopped short and another load should go on from where it stopped. */
static __always_inline int load_window(struct scratch *s)
{
    u32 off = s->off;
    s->base = off;
    s->n = 0;
    if (off >= s->total)
        return 0;
    if (s->kind == IO_BUF) {
        if (off >= s->len)
            return 0;
        u64 want = s->total - off;
        if (want > s->len - off)
            want = s->len - off;
        u32 sz = want < SCRATCH_SIZE ? want : SCRATCH_SIZE;
        if (sz > 0 && sz <= SCRATCH_SIZE &&
            read_user(s->buf, sz, (void *)(s->ptr + off)) == 0)
            s->n = sz;
        else
            count(CNT_READ_COPY_FAILED);
        return 0;
    }
    if (s->kind != IO_IOV)
        return 0;
    u32 n = 0;
#pragma unroll
    for (int k = 0; k < IOV_WALK; k++) {
        u64 at = off + n;                   /* data offset of the next byte to gather */
        if (at >= s->total || n >= SCRATCH_SIZE || s->iov_idx >= s->len)
            break;
        struct iovec v = {};
        if (read_user(&v, sizeof(v), (void *)(s->ptr + s->iov_idx * sizeof(v)))) {
            count(CNT_READ_COPY_FAILED);
            break;
        }
        if (at >= s->iov_start + v.iov_len) {   /* wholly before `at`: step over it */
            s->iov_start += v.iov_len;
            s->iov_idx++;
            continue;
        }
        u64 in = at - s->iov_start;
        u64 want = v.iov_len - in;
        if (want > s->total - at)
            want = s->total - at;
        if (want > SCRATCH_SIZE - n)
            want = SCRATCH_SIZE - n;
        u32 sz = want < SCRATCH_SIZE ? want : SCRATCH_SIZE;
        /* buf is twice the window, so the verifier sees pos + sz inside it (pos is re-read
         * and masked, not derived from the bounds the compiler knows) */
        s->n = n;
        u32 pos = VLD(s->n) & (SCRATCH_SIZE - 1);
        if (sz == 0 || sz > SCRATCH_SIZE ||
            read_user(&s->buf[pos], sz, (void *)((u64)v.iov_base + in))) {
            count(CNT_READ_COPY_FAILED);
            break;
        }
        n += sz;
        if (in + sz >= v.iov_len) {         /* this iovec is used up */
            s->iov_start += v.iov_len;
            s->iov_idx++;
        }
    }
    s->n = n;
    return n == 0 && s->iov_idx < s->len && off < s->total;
}

static __always_inline u8 lc(u8 ch)
{
    return (ch >= 'A' && ch <= 'Z') ? ch + 32 : ch;
}

/* RFC 9110 tchar: the bytes of a token (method, header name, transfer coding). */
static __always_inline int is_tchar(u8 ch)
{
    if ((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9'))
        return 1;
    switch (ch) {
    case '!': case '#': case '$': case '%': case '&': case '\'': case '*': case '+': case '-':
    case '.': case '^': case '_': case '`': case '|': case '~':
        return 1;
    }
    return 0;
}

static __always_inline int hexval(u8 ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    ch = lc(ch);
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    return -1;
}

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

/* The first eight bytes of a string literal as a little-endian word (folded at compile time):
 * names are compared a word at a time, not a byte at a time, to keep the scan loop small. */
static __always_inline u64 word8(const char *lit)
{
    u64 v = 0;
    __builtin_memcpy(&v, lit, 8);
    return v;
}

/* The low n bytes of a word (n < 8). */
#define LOW(w, n) ((w) & ((1ULL << (8 * (n))) - 1))

/* The header name just read (at its ':'), as one of H_*. name[] is lowercased. */
static __always_inline u8 which_header(struct hparse *p)
{
    u64 w0 = *(u64 *)&p->name[0], w1 = *(u64 *)&p->name[8], w2 = *(u64 *)&p->name[16];
    u8 n = p->nlen;
    if (n == 11 && w0 == word8("tracepar") && LOW(w1, 3) == word8("ent\0\0\0\0"))
        return H_TP;
    if (n == 14 && w0 == word8("content-") && LOW(w1, 6) == word8("length\0"))
        return H_CL;
    if (n == 17 && w0 == word8("transfer") && w1 == word8("-encodin") && LOW(w2, 1) == 'g')
        return H_TE;
    return H_OTHER;
}

/* One byte of a header name. Names are matched as they stream in, so a name split across reads
 * (or windows) is still recognised. Returns the header id at ':' (state moves to its value), or
 * -1 while the name goes on. */
static __always_inline int name_byte(struct hparse *p, u8 ch)
{
    if (ch == ':' || ch == ' ' || ch == '\t') {
        u8 h = which_header(p);
        if (ch != ':') {
            /* whitespace before the colon: a server must reject the message (RFC 9112 5.1);
             * for a framing header we cannot know how the server reads it */
            if (h == H_CL)
                p->fr |= FR_CL_BAD;
            else if (h == H_TE)
                p->fr |= FR_TE | FR_TE_BAD;
            p->hdr = H_OTHER;
            p->state = P_SKIP_LINE;
            return -1;
        }
        p->hdr = h;
        if (h == H_CL) {
            if (p->fr & (FR_CL | FR_CL_BAD))
                p->fr |= FR_CL_BAD;     /* a second Content-Length: unframed (RFC 9112 6.3) */
            p->len = 0;
            p->sub = 0;
            p->state = P_CL_VALUE;
        } else if (h == H_TE) {
            p->fr |= FR_TE;
            p->fr &= ~FR_TE_CHUNKED;    /* the last coding of the last TE line decides */
            p->sub = 0;
            p->state = P_TE_VALUE;
        } else {
            p->state = P_SKIP_LINE;     /* H_TP is taken over by the request scanner */
        }
        return h;
    }
    if (ch == '\n') {                   /* a line without a colon: nothing to frame by */
        p->state = P_LINE_START;
        return -1;
    }
    u8 n = p->nlen;
    if (n >= 17) {                      /* longer than any name we match */
        p->state = P_SKIP_LINE;
        return -1;
    }
    p->name[n] = lc(ch);
    p->nlen = n + 1;
    if (n == 7) {                       /* 8 bytes in: give up early on any other name */
        u64 w0 = *(u64 *)&p->name[0];
        if (w0 != word8("tracepar") && w0 != word8("content-") && w0 != word8("transfer"))
            p->state = P_SKIP_LINE;
    }
    return -1;
}

/* A header line starts at i: look at its first 8 bytes at once. A name we match starts with
 * "tracepar", "transfer" or "content-" (any case): its 8 bytes go to name[] and 8 is returned;
 * any other name cannot be one of ours, so the line is skipped (0). -1 when this needs the
 * byte path (the end of the section, an obs-fold, fewer than 8 bytes in the window). */
static __always_inline int name_word(struct scratch *s, struct hparse *p, u32 i)
{
    u32 at = i - s->base;
    if (at + 8 > s->n)
        return -1;
    u64 raw = *(u64 *)&s->buf[at & (SCRATCH_SIZE - 1)];
    u8 first = raw;
    if (first == '\r' || first == '\n' || first == ' ' || first == '\t')
        return -1;
    /* | 0x20 lowercases letters and turns no other byte into a letter; the '-' of "content-"
     * is checked as sent (CR | 0x20 is '-') */
    u64 w = raw | 0x2020202020202020ULL;
    p->hdr = H_OTHER;
    if (w == word8("tracepar") || w == word8("transfer") ||
        (w == word8("content-") && (u8)(raw >> 56) == '-')) {
        *(u64 *)&p->name[0] = w;
        p->nlen = 8;
        p->state = P_NAME;
        return 8;
    }
    p->state = P_SKIP_LINE;
    return 0;
}

/* One byte at the start of a header line: the end of the section, an obs-fold continuation,
 * or the first byte of a name. Returns STEP_HDR_END at the empty line, else STEP_GO. */
static __always_inline int line_start_byte(struct hparse *p, u8 ch)
{
    if (ch == '\r') {
        p->state = P_CR;
        return STEP_GO;
    }
    if (ch == '\n')                     /* a bare LF ends the line (RFC 9112 2.2) */
        return STEP_HDR_END;
    if (ch == ' ' || ch == '\t') {
        /* obs-fold: the previous line goes on. A folded length or coding cannot be trusted;
         * a folded traceparent is continued by the request scanner. */
        if (p->hdr == H_CL)
            p->fr |= FR_CL_BAD;
        else if (p->hdr == H_TE)
            p->fr |= FR_TE_BAD;
        p->state = P_SKIP_LINE;
        return STEP_GO;
    }
    p->hdr = H_OTHER;
    ch = lc(ch);
    if (ch != 't' && ch != 'c') {       /* no name we match starts otherwise: skip the line */
        p->state = P_SKIP_LINE;
        return STEP_GO;
    }
    p->name[0] = ch;
    p->nlen = 1;
    p->state = P_NAME;
    return STEP_GO;
}

/* One byte of a Content-Length value: OWS, 1*DIGIT, OWS, end of line. Anything else ("1 0",
 * "5x", "5, 5", empty) makes the message unframed. sub: 0 before the digits, 1 in them, 2 after. */
static __always_inline void cl_byte(struct hparse *p, u8 ch)
{
    if (ch == '\n') {
        if (p->sub == 0)
            p->fr |= FR_CL_BAD;
        else if (!(p->fr & FR_CL_BAD))
            p->fr |= FR_CL;
        p->state = P_LINE_START;
        return;
    }
    if (ch == '\r' || ch == ' ' || ch == '\t') {
        if (p->sub == 1)
            p->sub = 2;
        return;
    }
    if (ch >= '0' && ch <= '9' && p->sub < 2) {
        p->sub = 1;
        if (p->len >= CL_MAX / 10)
            p->fr |= FR_CL_BAD;
        else
            p->len = p->len * 10 + (ch - '0');
        return;
    }
    p->fr |= FR_CL_BAD;
    p->state = P_SKIP_LINE;
}

/* "chunked", little-endian, so byte k is (CHUNKED >> 8k) & 0xff */
#define CHUNKED_LE 0x64656b6e756863ULL
#define TE_BROKEN 0x80                  /* sub: this coding is not "chunked" */

/* One byte of a Transfer-Encoding value: a list of codings; only whether the final one is
 * "chunked" matters. sub: bytes of "chunked" matched in the current coding. */
static __always_inline void te_byte(struct hparse *p, u8 ch)
{
    u8 k = p->sub;
    if (ch == '\n' || ch == ',') {
        if (k == 7)
            p->fr |= FR_TE_CHUNKED;
        else
            p->fr &= ~FR_TE_CHUNKED;
        p->sub = 0;
        if (ch == '\n')
            p->state = P_LINE_START;
        return;
    }
    if (ch == ' ' || ch == '\t' || ch == '\r') {
        if (k > 0 && k < 7)
            p->sub = TE_BROKEN;         /* "chun ked" */
        return;
    }
    if (k < 7 && lc(ch) == (u8)(CHUNKED_LE >> (8 * k)))
        p->sub = k + 1;
    else if (is_tchar(ch) || ch == ';' || ch == '=' || ch == '"')
        p->sub = TE_BROKEN;             /* another coding, or a parameter */
    else
        p->fr |= FR_TE_BAD;
}

/* One step of a framed body (Content-Length or chunked). Returns STEP_NEXT when the message is
 * complete, STEP_STOP when this read/write is used up, STEP_RELOAD for a byte outside the
 * window, STEP_BAD on a chunked syntax error, else STEP_GO. Chunk data is skipped by count. */
static __always_inline int body_step(struct scratch *s, struct hparse *p, u32 i, u64 *counted)
{
    u8 st = VLD(p->state);
    if (st == P_BODY)
        return skip_body(s, i, &p->len, counted) ? STEP_NEXT : STEP_STOP;
    if (st == P_CHUNK_DATA) {
        if (!skip_body(s, i, &p->len, counted))
            return STEP_STOP;
        p->state = P_CHUNK_END;
        p->sub = 0;
        return STEP_GO;
    }
    if (!visible(s, i))
        return STEP_RELOAD;
    u8 ch = BYTE(i);
    s->off = i + 1;
    *counted += 1;
    if (st == P_CHUNK_SIZE) {
        int h = hexval(ch);
        if (h >= 0) {
            if (p->len >= CL_MAX / 16)
                return STEP_BAD;
            p->len = p->len * 16 + h;
            p->sub = 1;
            return STEP_GO;
        }
        if (!p->sub)
            return STEP_BAD;            /* a chunk size needs a digit */
        if (ch == '\n')
            goto size_done;
        if (ch == ';' || ch == ' ' || ch == '\t' || ch == '\r') {
            p->state = P_CHUNK_EXT;     /* chunk extensions: ignored */
            return STEP_GO;
        }
        return STEP_BAD;
    }
    if (st == P_CHUNK_EXT) {
        if (ch == '\n')
            goto size_done;
        return STEP_GO;
    }
    if (st == P_CHUNK_END) {            /* the CRLF after chunk data */
        if (ch == '\r' && !p->sub) {
            p->sub = 1;
            return STEP_GO;
        }
        if (ch != '\n')
            return STEP_BAD;
        p->state = P_CHUNK_SIZE;
        p->len = 0;
        p->sub = 0;
        return STEP_GO;
    }
    if (st == P_TRAILER) {              /* trailer lines after the last chunk, then CRLF */
        if (ch == '\n')
            return STEP_NEXT;
        if (ch != '\r')
            p->state = P_TRAILER_SKIP;
        return STEP_GO;
    }
    if (st == P_TRAILER_SKIP) {
        if (ch == '\n')
            p->state = P_TRAILER;
        return STEP_GO;
    }
    return STEP_BAD;
size_done:
    p->state = p->len ? P_CHUNK_DATA : P_TRAILER;
    p->sub = 0;
    return STEP_GO;
}

static __always_inline int in_body(u8 st)
{
    return st >= P_BODY && st <= P_TRAILER_SKIP;
}

static __always_inline void reset_parser(struct hparse *p, u8 state)
{
    p->state = state;
    p->len = 0;
    p->fr = 0;
    p->hdr = H_OTHER;
    p->sub = 0;
    p->nlen = 0;
}

/* Untracked requests (pipeline slots full, or state evicted) are framed like the others in
 * one scribble record per connection, in `reqs` under this sequence number (one map, so the
 * verifier sees one kind of record pointer), never emitted. */
#define GHOST_SEQ (~0ULL)

static __always_inline struct http_record *ghost_record(u64 sk)
{
    int z = 0;
    struct req_key key = {.sk = sk, .seq = GHOST_SEQ};
    struct http_record *rec = reqs.lookup(&key);
    if (rec)
        return rec;
    struct http_record *tmpl = zero_rec.lookup(&z);
    if (!tmpl)
        return 0;
    reqs.update(&key, tmpl);
    return reqs.lookup(&key);
}

/* The record of request `seq`: its map entry, or the ghost record when it is not tracked
 * (counted once: in pipeline_slots_full at open, or here when its state was evicted). */
static __always_inline struct http_record *current_request(struct scratch *s, struct conn *c,
                                                           u64 seq)
{
    u64 bit = 1ULL << (seq & 63);
    if (!(c->ghost_bits & bit)) {
        struct http_record *rec = h1_record(s->sk, c, seq);
        if (rec)
            return rec;
        count(CNT_REQUEST_STATE_LOST);
        c->ghost_bits |= bit;
        h1_release(c, seq);
    }
    return ghost_record(s->sk);
}
