/* The response scanner (tail call PROG_SCAN_RESP). Part of the bpf/http.c compile unit.
 *
 * Responses answer the open requests in order. Each one is parsed as it streams out, whatever
 * the writes look like: a status line split across writes, headers longer than one window,
 * chunk sizes in later iovecs of a writev or past the first window. It ends (and emits its
 * request's record) after its Content-Length bytes, at the end of a chunked body, at the end
 * of the headers for HEAD/1xx/204/304, or with the connection (close-delimited). A response
 * that cannot be framed ends its request there, flagged REQF_RESP_UNTERM, and the connection
 * is no longer trusted or scanned.
 */

/* "HTTP/1.", little-endian: byte k is (HTTP1_LE >> 8k) & 0xff */
#define HTTP1_LE 0x2e312f50545448ULL

/* The response to request `seq` ended: emit its record (when tracked), move on to the next. */
static __always_inline void complete_response(struct scratch *s, struct conn *c, u64 seq,
                                              struct http_record *rec)
{
    if (!(c->ghost_bits & (1ULL << (seq & 63)))) {
        rec->status = c->rs_status;
        finish_request_in_scanner(s, rec, c);
        emit(rec);
        rec->conn_id = 0;       /* sent: the slot's entry waits for the connection's next */
        h1_release(c, seq);
    }
    c->head = seq + 1;
    reset_parser(&c->rs, P_STATUS);
    c->rs_status = 0;
}

/* The response cannot be framed from here: end it now, unterminated, and stop scanning writes.
 * Requests still open end when the connection does (REQF_NO_RESPONSE). */
static __always_inline void lose_response(struct scratch *s, struct conn *c, u64 seq,
                                          struct http_record *rec, u32 reason)
{
    untrust(c, reason);
    rec->flags |= REQF_RESP_UNTERM;
    complete_response(s, c, seq, rec);
    c->flags |= CONN_RESP_LOST;
}

/* A status line's first 8 bytes at once, "HTTP/1." and a digit: what the first eight P_STATUS
 * steps check. -1: take the byte path (a split line, or anything else, which it rejects). */
static __always_inline int version_word(struct scratch *s, struct hparse *p, u32 i)
{
    u64 x;
    if (!word_at(s, i, &x))
        return -1;
    u8 minor = x >> 56;
    if ((x & 0x00FFFFFFFFFFFFFFULL) != HTTP1_LE || minor < '0' || minor > '9')
        return -1;
    p->sub = 8;
    return 8;
}

/* The header section ended: frame the body (RFC 9112 6.3). */
static __always_inline int response_headers_end(struct conn *c, struct http_record *rec)
{
    struct hparse *p = &c->rs;
    u16 code = c->rs_status;
    u64 bit = 1ULL << (c->head & 63);
    u8 fr = p->fr;
    if (code >= 100 && code < 200 && code != 101) {
        reset_parser(p, P_STATUS);              /* interim (100 Continue): the final follows */
        c->rs_status = 0;
        return STEP_GO;
    }
    if ((c->head_bits & bit) || code == 204 || code == 304)
        return STEP_NEXT;
    if (code == 101 || ((c->connect_bits & bit) && code >= 200 && code < 300)) {
        c->flags |= CONN_IGNORED;               /* upgraded or tunnelled: no longer HTTP/1.x */
        return STEP_NEXT;
    }
    if (fr & FR_TE) {
        /* Transfer-Encoding overrides Content-Length; without a final chunked coding the
         * response is delimited by the close */
        if ((fr & FR_TE_CHUNKED) && !(fr & FR_TE_BAD)) {
            p->state = P_CHUNK_SIZE;
            p->len = 0;
            p->sub = 0;
            return STEP_GO;
        }
    } else if (fr & FR_CL_BAD) {
        return STEP_BAD;
    } else if (fr & FR_CL) {
        if (!p->len)
            return STEP_NEXT;
        p->state = P_BODY;
        return STEP_GO;
    }
    p->state = P_OPAQUE;                        /* close-delimited: ends with the connection */
    rec->flags |= REQF_RESP_UNTERM;
    return STEP_GO;
}

static __always_inline int step_resp(struct scratch *s, struct conn *c, struct http_record *rec)
{
    struct hparse *p = &c->rs;
    u32 i = VLD(s->off);
    u8 st = VLD(p->state);
    if (i >= s->total)
        return STEP_STOP;
    if (in_body(st))
        return body_step(s, p, i, &rec->resp_bytes);
    if (st == P_OPAQUE) {
        rec->resp_bytes += s->total - i;
        s->off = s->total;
        return STEP_STOP;
    }
    if (!visible(s, i))
        return STEP_RELOAD;
    /* fast paths: a skipped line 8 bytes a step (to its end); a header name's first 8 and
     * "HTTP/1.x" at once */
    int adv = -1;
    if (st == P_LINE_REST || st == P_SKIP_LINE)
        adv = skip_line_word(s, p, i);
    else if (st == P_LINE_START)
        adv = name_word(s, p, i);
    else if (st == P_STATUS && p->sub == 0)
        adv = version_word(s, p, i);
    if (adv >= 0) {
        s->off = i + adv;
        rec->resp_bytes += adv;
        return STEP_GO;
    }
    u8 ch = BYTE(i);
    s->off = i + 1;
    rec->resp_bytes += 1;
    int ret = STEP_GO;
    if (st == P_STATUS) {
        /* "HTTP/1.x NNN", one byte at a time: a status line may be split across writes */
        u8 k = p->sub;
        if (k < 7) {
            if (ch != (u8)(HTTP1_LE >> (8 * k)))
                return STEP_BAD;
        } else if (k == 7) {
            if (ch < '0' || ch > '9')
                return STEP_BAD;
        } else if (k == 8) {
            if (ch != ' ')
                return STEP_BAD;
        } else {
            if (ch < (k == 9 ? '1' : '0') || ch > (k == 9 ? '5' : '9'))
                return STEP_BAD;
            c->rs_status = c->rs_status * 10 + (ch - '0');
            if (k == 11)
                p->state = P_LINE_REST;
        }
        p->sub = k + 1;
    } else if (st == P_LINE_REST || st == P_SKIP_LINE) {
        if (ch == '\n')
            p->state = P_LINE_START;
    } else if (st == P_LINE_START) {
        if (line_start_byte(p, ch) == STEP_HDR_END)
            ret = response_headers_end(c, rec);
    } else if (st == P_CR) {
        if (ch == '\n')
            ret = response_headers_end(c, rec);
        else
            p->state = P_SKIP_LINE;
    } else if (st == P_NAME) {
        name_byte(p, ch);
    } else if (st == P_CL_VALUE) {
        cl_byte(p, ch);
    } else if (st == P_TE_VALUE) {
        te_byte(p, ch);
    }
    return ret;
}

/* bpf_loop callback of scan_resp: LOOP_STEPS steps of the response to the oldest request open.
 * 1 stops the loop; the scan's step result says why. Kept apart from scan_req_steps, not one
 * body for both: clang inlines both step functions into a shared body before the direction is
 * known, and the compile took ~0.2 s longer (3.32 vs 3.12 s, a node's first start). */
int scan_resp_steps(struct loop_arg a)
{
    struct scan_loop *l = a.ctx;
    struct scratch *s = l->s;
    int r = STEP_GO;
#pragma unroll 1
    for (int k = 0; k < LOOP_STEPS; k++) {
        r = step_resp(s, l->c, l->rec);
        if (r != STEP_GO)
            break;
    }
    s->step = r;
    return r != STEP_GO;
}

int scan_resp(void *ctx)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    if (!s)
        return 0;
    u64 sk = s->sk;
    struct conn *c = conns.lookup(&sk);
    if (!c || (c->flags & (CONN_IGNORED | CONN_RESP_LOST)) || c->head >= c->tail)
        return 0;
    if (!visible(s, s->off) && s->off < s->total && !skipping(c->rs.state))
        s->walk_more = load_window(s);
    u64 seq = c->head;
    struct http_record *rec = current_request(s, c, seq);
    if (!rec)
        return 0;
    if (c->rs.state == P_STATUS && c->rs.sub == 0) {
        if (!rec->resp_start_ns)
            rec->resp_start_ns = s->now;    /* (unacked_max restarted in sock_send_length) */
        /* The server answers a request whose headers we have not seen end: it framed that
         * request differently (an error it answers early, or bytes we cannot see). */
        u8 rq = c->rq.state;
        if (seq + 1 == c->tail && rq > P_TARGET && rq < P_BODY)
            untrust(c, CNT_UNTRUSTED_EARLY_RESPONSE);
    }
    struct scan_loop l = {.s = s, .c = c, .rec = rec};
    s->step = STEP_GO;
    bpf_loop(SCAN_CHUNK / LOOP_STEPS, LOOP_CB(scan_resp_steps), &l, 0);
    int r = VLD(s->step);
    if (r == STEP_NEXT) {
        u16 code = c->rs_status;
        complete_response(s, c, seq, rec);
        if (code == 101) {
            /* Upgraded: HTTP/2 if the next bytes say so (bpf/http2_scan.h goes on). Decided
             * here, out of the step loop: a branch in response_headers_end costs the verifier
             * over 250k more instructions processed, past the 1M limit. */
            c->flags = (c->flags & ~CONN_IGNORED) | CONN_H2 | CONN_H2_NEW;
            progs.call(ctx, PROG_H2_WR);
            h2_not_loaded(c);
            return 0;
        }
    } else if (r == STEP_BAD) {
        lose_response(s, c, seq, rec,
                      in_body(c->rs.state) ? CNT_UNTRUSTED_CHUNKED : CNT_UNTRUSTED_RESPONSE_INVALID);
        return 0;
    }
    /* more bytes: the same response, or pipelined responses sharing one write */
    if (r == STEP_STOP || s->off >= s->total || c->head >= c->tail ||
        (c->flags & (CONN_IGNORED | CONN_RESP_LOST)))
        return 0;
    if (r == STEP_RELOAD && s->base == s->off && s->n == 0 && !s->walk_more) {
        lose_response(s, c, seq, rec, CNT_UNTRUSTED_UNSCANNED);   /* bytes we cannot see */
        return 0;
    }
    if (s->chain < CHAIN_MAX) {
        s->chain++;
        progs.call(ctx, PROG_SCAN_RESP);
    }
    /* out of tail calls with bytes to frame */
    if (c->head == seq) {
        lose_response(s, c, seq, rec, CNT_UNTRUSTED_UNSCANNED);
    } else {
        untrust(c, CNT_UNTRUSTED_UNSCANNED);    /* the next response starts where we stop */
        c->flags |= CONN_RESP_LOST;
    }
    return 0;
}
