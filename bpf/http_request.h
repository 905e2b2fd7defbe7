/* The request scanner (tail call PROG_SCAN_REQ): finds request lines, copies method and path,
 * captures traceparent, frames bodies so pipelined requests are separated. Part of the
 * bpf/http.c compile unit.
 */

/* Byte k of the data at a request boundary: bytes carried from earlier reads come first. */
static __always_inline u8 peek(struct scratch *s, struct conn *c, u32 k)
{
    u32 pl = c->rq_plen;
    if (k < pl)
        return c->rq_prefix[k & (PREFIX_MAX - 1)];
    return BYTE(s->off + k - pl);
}

#define NEED_MORE 0xff

/* A method followed by a space and the start of a request target: the method's length; 0 when
 * this is not a request line; NEED_MORE when too few bytes have arrived to tell. */
static __always_inline u32 method_at(struct scratch *s, struct conn *c)
{
    u32 avail = c->rq_plen + (s->n > s->off ? s->n - s->off : 0);
    if (avail < 4) {
        for (u32 k = 0; k < 3; k++)
            if (k < avail && (peek(s, c, k) < 'A' || peek(s, c, k) > 'Z'))
                return 0;
        return NEED_MORE;
    }
    u8 a = peek(s, c, 0), b = peek(s, c, 1), d = peek(s, c, 2), e = peek(s, c, 3);
    u32 len = 0;
    if (a == 'G' && b == 'E' && d == 'T') len = 3;
    else if (a == 'P' && b == 'U' && d == 'T') len = 3;
    else if (a == 'P' && b == 'O' && d == 'S' && e == 'T') len = 4;
    else if (a == 'H' && b == 'E' && d == 'A' && e == 'D') len = 4;
    else if (a == 'P' && b == 'A' && d == 'T' && e == 'C') len = 5;
    else if (a == 'D' && b == 'E' && d == 'L' && e == 'E') len = 6;
    else if (a == 'O' && b == 'P' && d == 'T' && e == 'I') len = 7;
    else if (a == 'T' && b == 'R' && d == 'A' && e == 'C') len = 5;
    else if (a == 'C' && b == 'O' && d == 'N' && e == 'N') len = 7;
    if (!len)
        return 0;
    if (avail < len + 2)
        return NEED_MORE;
    if (peek(s, c, len) != ' ')
        return 0;
    u8 t = peek(s, c, len + 1);
    if (t != '/' && t != '*' && t != 'h')   /* origin-, asterisk- or absolute-form target */
        return 0;
    return len;
}

/* Keep the few bytes of a request line that arrived alone, for the next read. */
static __always_inline void carry_prefix(struct scratch *s, struct conn *c)
{
#pragma unroll
    for (u32 k = 0; k < PREFIX_MAX - 1; k++) {
        u32 pl = c->rq_plen;
        if (s->off >= s->n || pl >= PREFIX_MAX - 1)
            break;
        c->rq_prefix[pl & (PREFIX_MAX - 1)] = BYTE(s->off);
        c->rq_plen = pl + 1;
        s->off++;
    }
}

/* A request line begins at s->off: open a record for it. Returns the record or 0. */
static __always_inline struct http_record *open_request(struct scratch *s, struct conn *c, u32 mlen)
{
    if (c->tail - c->head >= MAX_PENDING) {
        count(CNT_PIPELINE_SLOTS_FULL);
        return 0;
    }
    int z = 0;
    struct http_record *tmpl = zero_rec.lookup(&z);
    if (!tmpl)
        return 0;
    struct req_key key = {.sk = s->sk, .seq = c->tail};
    if (reqs.update(&key, tmpl) != 0)
        return 0;
    struct http_record *rec = reqs.lookup(&key);
    if (!rec)
        return 0;
    u64 id = bpf_get_current_pid_tgid();
    rec->type = REC_HTTP;
    rec->pid = id >> 32;
    rec->tid = (u32)id;
    rec->fd = s->fd;
    rec->conn_id = c->conn_id;
    rec->seq = c->tail;
    rec->read_ns = s->now;
    rec->arrival_ns = (c->arrival_ns && c->arrival_ns <= s->now) ? c->arrival_ns : 0;
    if (!(c->flags & CONN_SEEN_REQ)) {
        rec->flags |= REQF_FIRST_ON_CONN;
        rec->est_ns = c->est_ns;
    }
    if (c->flags & CONN_TUPLE) {
        rec->flags |= REQF_TUPLE;
        rec->family = c->family;
        rec->lport = c->lport;
        rec->rport = c->rport;
        __builtin_memcpy(rec->laddr, c->laddr, 16);
        __builtin_memcpy(rec->raddr, c->raddr, 16);
    }
    rec->method_len = mlen;
#pragma unroll
    for (u32 k = 0; k < HTTP_METHOD_MAX; k++)
        if (k < mlen)
            rec->method[k] = peek(s, c, k);
    rec->retrans = -c->retrans;
    start_thread_stats(rec, rec->tid);
    c->flags |= CONN_SEEN_REQ;
    c->tail++;
    c->rq_state = RQ_PATH;
    c->rq_scanned = mlen + 1;
    c->rq_cl = 0;
    c->rq_tpraw = 0;
    s->off += mlen + 1 - c->rq_plen;   /* carried bytes are never more than method + space */
    c->rq_plen = 0;
    return rec;
}

static __always_inline int step_req(struct scratch *s, struct conn *c, struct http_record *rec)
{
    u32 i = VLD(s->off);
    u8 st = VLD(c->rq_state);
    if (i >= s->total)
        return STEP_STOP;
    if (st == RQ_BODY) {
        if (!skip_body(s, i, &c->rq_body, &rec->req_bytes))
            return STEP_STOP;
        c->rq_state = RQ_NONE;
        return STEP_NEXT;
    }
    if (st == RQ_UNFRAMED || st == RQ_OVERFLOW || st == RQ_NONE) {
        if (st != RQ_NONE)
            rec->req_bytes += s->total - i;
        s->off = s->total;
        return STEP_STOP;
    }
    if (i >= s->n) {
        if (s->total > s->n) {      /* headers go on past what we could copy: the window */
            rec->flags |= REQF_TP_WINDOW;
            c->rq_state = RQ_OVERFLOW;
            return STEP_GO;
        }
        return STEP_STOP;
    }
    if (c->rq_scanned >= HDR_WINDOW) {
        rec->flags |= REQF_TP_WINDOW;
        c->rq_state = RQ_OVERFLOW;
        return STEP_GO;
    }
    u8 ch = BYTE(i);
    u32 adv = 1;
    int ret = STEP_GO;
    int hdr_end = 0;
    if (st == RQ_PATH) {
        if (ch == ' ' || ch == '?' || ch == '\r') {
            st = RQ_LINE_REST;
        } else if (ch == '\n') {
            st = RQ_LINE_START;
        } else {
            u32 pl = rec->path_len;
            if (pl < HTTP_PATH_MAX) {
                rec->path[pl] = ch;
                rec->path_len = pl + 1;
            } else {
                rec->flags |= REQF_PATH_TRUNC;
            }
        }
    } else if (st == RQ_LINE_REST || st == RQ_SKIP_LINE) {
        if (ch == '\n')
            st = RQ_LINE_START;
    } else if (st == RQ_LINE_START) {
        if (ch == '\r') {
            st = RQ_CR;
        } else if (ch == '\n') {
            hdr_end = 1;
        } else if (hdr_is(s, i, "traceparent", 11)) {
            if (rec->tp_count < 255)
                rec->tp_count++;
            adv = 12;
            st = rec->tp_count == 1 ? RQ_TP_OWS : RQ_SKIP_LINE;
        } else if (hdr_is(s, i, "content-length", 14)) {
            adv = 15;
            c->rq_cl = 0;
            st = RQ_CL_VALUE;
        } else if (hdr_is(s, i, "transfer-encoding", 17)) {
            adv = 18;
            c->rq_cl = CL_MAX;      /* a chunked request body: framing we do not follow */
            st = RQ_SKIP_LINE;
        } else {
            st = RQ_SKIP_LINE;
        }
    } else if (st == RQ_CR) {
        if (ch == '\n')
            hdr_end = 1;
        else
            st = RQ_SKIP_LINE;
    } else if (st == RQ_TP_OWS || st == RQ_TP_VALUE) {
        if (ch == '\r') {
            st = RQ_SKIP_LINE;
        } else if (ch == '\n') {
            st = RQ_LINE_START;
        } else if (st == RQ_TP_OWS && (ch == ' ' || ch == '\t')) {
            /* optional whitespace before the value */
        } else {
            st = RQ_TP_VALUE;
            u32 pos = c->rq_tpraw;
            if (pos < TP_CAP)
                rec->tp[pos] = ch;
            if (pos < 0xffff)
                c->rq_tpraw = pos + 1;
            if (ch != ' ' && ch != '\t')
                rec->tp_len = c->rq_tpraw;
        }
    } else if (st == RQ_CL_VALUE) {
        st = cl_byte(&c->rq_cl, ch, RQ_CL_VALUE, RQ_LINE_START, RQ_SKIP_LINE);
    }
    if (hdr_end) {
        rec->flags |= REQF_HDR_DONE;
        u64 cl = c->rq_cl;
        if (cl >= CL_MAX) {
            st = RQ_UNFRAMED;
        } else if (cl > 0) {
            c->rq_body = cl;
            st = RQ_BODY;
        } else {
            st = RQ_NONE;
            ret = STEP_NEXT;
        }
    }
    s->off = i + adv;
    c->rq_scanned += adv;
    rec->req_bytes += adv;
    c->rq_state = st;
    return ret;
}

int scan_req(void *ctx)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    if (!s)
        return 0;
    u64 sk = s->sk;
    struct conn *c = conns.lookup(&sk);
    if (!c)
        return 0;
    struct http_record *rec = 0;
    if (c->rq_state == RQ_NONE) {
        if (s->off >= s->total)
            goto out;
        u32 mlen = method_at(s, c);
        if (mlen == NEED_MORE) {
            carry_prefix(s, c);
            return 0;   /* keep the arrival time: the request has begun to arrive */
        }
        if (!mlen) {
            c->rq_plen = 0;
            if (!(c->flags & CONN_SEEN_REQ)) {
                /* A response being read ("HTTP/"): a client's socket we met mid-life (older
                 * than the agent, or evicted), not a non-HTTP server connection. */
                if (!(s->n - s->off >= 5 && BYTE(s->off) == 'H' && BYTE(s->off + 1) == 'T' &&
                      BYTE(s->off + 2) == 'T' && BYTE(s->off + 3) == 'P' &&
                      BYTE(s->off + 4) == '/'))
                    count(CNT_NON_HTTP_CONNECTIONS);
                c->flags |= CONN_IGNORED;
            }
            goto out;   /* not a request line: an unframed body, or noise: skip this read */
        }
        rec = open_request(s, c, mlen);
        if (!rec)
            goto out;
    } else {
        struct req_key key = {.sk = sk, .seq = c->tail - 1};
        rec = reqs.lookup(&key);
        if (!rec) {
            count(CNT_REQUEST_STATE_LOST);
            c->rq_state = RQ_NONE;
            goto out;
        }
        if (s->off == 0 && c->rq_state == RQ_TP_VALUE)
            rec->flags |= REQF_TP_SPLIT;
    }
    int r = STEP_GO;
#pragma unroll 1
    for (int iter = 0; iter < SCAN_CHUNK; iter++) {
        r = step_req(s, c, rec);
        if (r != STEP_GO)
            break;
    }
    if (r != STEP_STOP && s->off < s->total && s->chain < 30) {
        s->chain++;
        progs.call(ctx, PROG_SCAN_REQ);
    }
out:
    /* This read is fully scanned: every request it opened took the arrival time; the next
     * arrival is new data. */
    c->arrival_ns = 0;
    return 0;
}
