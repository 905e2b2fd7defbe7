/* The response scanner (tail call PROG_SCAN_RESP): status code and the end of each response
 * (Content-Length, chunked, HEAD/1xx/204/304, close), which emits the request's record. Part of
 * the bpf/http.c compile unit.
 */

/* "HTTP/1.x NNN" at offset i: the status code, or 0. */
static __always_inline u16 status_at(struct scratch *s, u32 i)
{
    if (i + 12 > s->n)
        return 0;
    if (BYTE(i) != 'H' || BYTE(i + 1) != 'T' || BYTE(i + 2) != 'T' || BYTE(i + 3) != 'P' ||
        BYTE(i + 4) != '/' || BYTE(i + 5) != '1' || BYTE(i + 6) != '.' || BYTE(i + 8) != ' ')
        return 0;
    u8 a = BYTE(i + 9), b = BYTE(i + 10), d = BYTE(i + 11);
    if (a < '1' || a > '5' || b < '0' || b > '9' || d < '0' || d > '9')
        return 0;
    return (a - '0') * 100 + (b - '0') * 10 + (d - '0');
}


/* The response to rec ended: emit it and move on to the next open request. */
static __always_inline void complete_response(struct scratch *s, struct conn *c,
                                              struct http_record *rec)
{
    rec->status = c->rs_status;
    finish_request(rec, c, s->now);
    emit(rec);
    struct req_key key = {.sk = s->sk, .seq = c->head};
    reqs.delete(&key);
    c->head++;
    c->rs_state = RS_STATUS;
    c->rs_status = 0;
}

static __always_inline int step_resp(struct scratch *s, struct conn *c, struct http_record *rec)
{
    u32 i = VLD(s->off);
    u8 st = VLD(c->rs_state);
    if (i >= s->total)
        return STEP_STOP;
    if (st == RS_BODY)
        return skip_body(s, i, &c->rs_body, &rec->resp_bytes) ? STEP_NEXT : STEP_STOP;
    if (st == RS_CHUNKED) {
        /* The body ends with the "0\r\n\r\n" chunk: keep the last 5 bytes written. */
        u32 end = s->total;
        if (end <= s->n && end - i >= 5) {
#pragma unroll
            for (int k = 0; k < 5; k++)
                c->rs_tail[k] = BYTE(end - 5 + k);
        } else if (end <= s->n) {
#pragma unroll
            for (int k = 0; k < 5; k++) {
                if (i + k < end) {
                    c->rs_tail[0] = c->rs_tail[1];
                    c->rs_tail[1] = c->rs_tail[2];
                    c->rs_tail[2] = c->rs_tail[3];
                    c->rs_tail[3] = c->rs_tail[4];
                    c->rs_tail[4] = BYTE(i + k);
                }
            }
        } else {
            c->rs_tail[0] = 0;      /* the tail lies beyond what we copied: cannot tell */
        }
        rec->resp_bytes += end - i;
        s->off = end;
        if (c->rs_tail[0] == '0' && c->rs_tail[1] == '\r' && c->rs_tail[2] == '\n' &&
            c->rs_tail[3] == '\r' && c->rs_tail[4] == '\n')
            return STEP_NEXT;
        return STEP_STOP;
    }
    if (st == RS_OPAQUE) {
        rec->resp_bytes += s->total - i;
        s->off = s->total;
        return STEP_STOP;
    }
    if (i >= s->n)
        return STEP_STOP;
    if (st == RS_STATUS) {
        u16 code = status_at(s, i);
        if (!code) {
            rec->flags |= REQF_RESP_UNTERM;
            c->rs_state = RS_OPAQUE;
            return STEP_GO;
        }
        c->rs_status = code;
        c->rs_cl = CL_MAX;          /* unknown until a Content-Length header says */
        c->rs_chunked = 0;
        rec->resp_bytes += 12;
        s->off = i + 12;
        c->rs_state = RS_LINE_REST;
        return STEP_GO;
    }
    u8 ch = BYTE(i);
    u32 adv = 1;
    int ret = STEP_GO;
    int hdr_end = 0;
    if (st == RS_LINE_REST || st == RS_SKIP_LINE) {
        if (ch == '\n')
            st = RS_LINE_START;
    } else if (st == RS_LINE_START) {
        if (ch == '\r') {
            st = RS_CR;
        } else if (ch == '\n') {
            hdr_end = 1;
        } else if (hdr_is(s, i, "content-length", 14)) {
            adv = 15;
            c->rs_cl = 0;
            st = RS_CL_VALUE;
        } else if (hdr_is(s, i, "transfer-encoding", 17)) {
            adv = 18;
            c->rs_chunked = 1;
            st = RS_SKIP_LINE;
        } else {
            st = RS_SKIP_LINE;
        }
    } else if (st == RS_CR) {
        if (ch == '\n')
            hdr_end = 1;
        else
            st = RS_SKIP_LINE;
    } else if (st == RS_CL_VALUE) {
        st = cl_byte(&c->rs_cl, ch, RS_CL_VALUE, RS_LINE_START, RS_SKIP_LINE);
    }
    if (hdr_end) {
        u16 code = c->rs_status;
        int head = rec->method_len == 4 && rec->method[0] == 'H';
        if (code >= 100 && code < 200 && code != 101) {
            st = RS_STATUS;         /* interim (100 Continue): the final response follows */
        } else if (head || code == 204 || code == 304 || code == 101) {
            if (code == 101)
                c->flags |= CONN_IGNORED;   /* upgraded: no longer HTTP/1.x */
            ret = STEP_NEXT;
        } else if (c->rs_chunked) {
            c->rs_tail[0] = 0;
            st = RS_CHUNKED;
        } else if (c->rs_cl < CL_MAX) {
            c->rs_body = c->rs_cl;
            st = RS_BODY;
            if (c->rs_cl == 0)
                ret = STEP_NEXT;
        } else {
            st = RS_OPAQUE;         /* close-delimited: ends when the connection does */
            rec->flags |= REQF_RESP_UNTERM;
        }
    }
    s->off = i + adv;
    rec->resp_bytes += adv;
    c->rs_state = st;
    return ret;
}

int scan_resp(void *ctx)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    if (!s)
        return 0;
    u64 sk = s->sk;
    struct conn *c = conns.lookup(&sk);
    if (!c || c->head >= c->tail)
        return 0;
    struct req_key key = {.sk = sk, .seq = c->head};
    struct http_record *rec = reqs.lookup(&key);
    if (!rec) {
        count(CNT_REQUEST_STATE_LOST);
        c->head++;
        c->rs_state = RS_STATUS;
        return 0;
    }
    if (!rec->resp_start_ns) {
        rec->resp_start_ns = s->now;
        c->unacked_max = 0;
        /* The server answers the latest request: whatever its headers did, it has been read.
         * A parser that lost the header end (window, unframed body) restarts here. */
        u8 rq = c->rq_state;
        if (c->head + 1 == c->tail && rq != RQ_NONE && rq != RQ_BODY)
            c->rq_state = RQ_NONE;
    }
    int r = STEP_GO;
#pragma unroll 1
    for (int iter = 0; iter < SCAN_CHUNK; iter++) {
        r = step_resp(s, c, rec);
        if (r != STEP_GO)
            break;
    }
    if (r == STEP_NEXT)
        complete_response(s, c, rec);
    /* more bytes: the same response's headers, or pipelined responses sharing one write */
    if (r != STEP_STOP && s->off < s->total && c->head < c->tail && s->chain < 30) {
        s->chain++;
        progs.call(ctx, PROG_SCAN_RESP);
    }
    return 0;
}
