/* The request scanner (tail call PROG_SCAN_REQ). Part of the bpf/http.c compile unit.
 *
 * A request opens at `token SP target`: the method is any RFC 9110 token of at most
 * HTTP_METHOD_MAX bytes, checked whole against the known set (else REQF_METHOD_OTHER; the raw
 * token is kept, and holds tchar bytes only). Only the path of the target is copied: the query,
 * ";params" of path segments, and the scheme, userinfo and host of an absolute-form target are
 * not. The header section is scanned for traceparent (within HDR_WINDOW) and for framing
 * (Content-Length, Transfer-Encoding) up to HDR_LIMIT; the body is framed as RFC 9112 6.3 says
 * a server must, so body bytes never open a request. Where framing is invalid or ambiguous the
 * connection stops being trusted (untrust(): counted by reason, no request opened after).
 */

static __always_inline void path_add(struct http_record *rec, u8 ch)
{
    u32 pl = rec->path_len;
    if (pl < HTTP_PATH_MAX) {
        rec->path[pl] = ch;
        rec->path_len = pl + 1;
    } else {
        rec->flags |= REQF_PATH_TRUNC;
    }
}

/* Eight bytes of the path at once (state P_PATH), when none of them ends it or starts a
 * parameter and they fit: what eight path_add() steps would do. -1: take the byte path. */
static __always_inline int path_word(struct scratch *s, struct http_record *rec, u32 i)
{
    u64 x;
    u32 pl = rec->path_len;
    if (pl > HTTP_PATH_MAX - 8 || !word_at(s, i, &x))
        return -1;
    if (has_byte(x, ' ') | has_byte(x, '?') | has_byte(x, '#') | has_byte(x, '\r') |
        has_byte(x, '\n') | has_byte(x, ';'))
        return -1;
    __builtin_memcpy(&rec->path[pl], &x, 8);
    rec->path_len = pl + 8;
    return 8;
}

/* Eight bytes of the traceparent value at once (states P_TP_OWS, P_TP_VALUE), when none of
 * them ends the line or is whitespace and they fit in tp[]: what eight byte steps would do.
 * The caller has checked that all eight are inside HDR_WINDOW. -1: take the byte path. */
static __always_inline int tp_word(struct scratch *s, struct conn *c, struct http_record *rec,
                                   u32 i)
{
    u64 x;
    u32 pos = c->rq_tpraw;
    if (pos > TP_CAP - 8 || !word_at(s, i, &x))
        return -1;
    if (has_byte(x, '\r') | has_byte(x, '\n') | has_byte(x, ' ') | has_byte(x, '\t'))
        return -1;
    __builtin_memcpy(&rec->tp[pos], &x, 8);
    c->rq_tpraw = pos + 8;
    rec->tp_len = pos + 8;
    c->rq.state = P_TP_VALUE;
    return 8;
}

/* Methods, raw (case-sensitive): the known set, checked whole. */
enum { M_OTHER, M_KNOWN, M_HEAD, M_CONNECT, M_PRI };

static __always_inline int method_kind(struct hparse *m)
{
    u64 w = *(u64 *)&m->name[0];
    u8 n = m->nlen;
    if (n == 3) {
        w = LOW(w, 3);
        if (w == word8("GET\0\0\0\0") || w == word8("PUT\0\0\0\0"))
            return M_KNOWN;
        return w == word8("PRI\0\0\0\0") ? M_PRI : M_OTHER;
    }
    if (n == 4) {
        w = LOW(w, 4);
        if (w == word8("HEAD\0\0\0"))
            return M_HEAD;
        return w == word8("POST\0\0\0") ? M_KNOWN : M_OTHER;
    }
    if (n == 5) {
        w = LOW(w, 5);
        return (w == word8("TRACE\0\0") || w == word8("PATCH\0\0")) ? M_KNOWN : M_OTHER;
    }
    if (n == 6)
        return LOW(w, 6) == word8("DELETE\0") ? M_KNOWN : M_OTHER;
    if (n == 7) {
        w = LOW(w, 7);
        if (w == word8("CONNECT"))
            return M_CONNECT;
        return w == word8("OPTIONS") ? M_KNOWN : M_OTHER;
    }
    return M_OTHER;
}

/* Bytes where a request had to start are not one. On a connection that never carried a request
 * this is not HTTP/1.x (or, for "HTTP/", a client's socket reading a response); afterwards it
 * means we and the server disagree about where the last request ended. */
static __always_inline int not_request(struct conn *c, u8 ch)
{
    if (!(c->flags & CONN_SEEN_REQ)) {
        struct hparse *m = &c->rq;
        if (!(ch == '/' && m->nlen == 4 && LOW(*(u64 *)&m->name[0], 4) == word8("HTTP\0\0\0")))
            count(CNT_NON_HTTP_CONNECTIONS);
        c->flags |= CONN_IGNORED;
    } else {
        untrust(c, CNT_UNTRUSTED_REQUEST_LINE);
    }
    return STEP_STOP;
}

/* `method SP t` has been read, t the target's first byte (at s->off): open request c->tail.
 * Its record is a map entry, or the ghost record when MAX_PENDING requests are already tracked
 * (then it is framed but not emitted, and counted in pipeline_slots_full). */
static __always_inline struct http_record *open_request(struct scratch *s, struct conn *c)
{
    struct hparse *m = &c->rq;
    u64 seq = c->tail;
    if (seq - c->head >= OUTSTANDING_MAX) {
        untrust(c, CNT_UNTRUSTED_PIPELINE_OVERFLOW);
        return 0;
    }
    int kind = method_kind(m);
    u32 i = s->off;
    u8 ch = BYTE(i);
    int alpha = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z');
    if (kind == M_PRI && ch == '*') {           /* "PRI * HTTP/2.0": the HTTP/2 preface */
        if (!(c->flags & CONN_SEEN_REQ))
            h2_start(c, s->sk, 4, 0);           /* its scanner checks the rest (http2_scan.h) */
        if (!(c->flags & CONN_H2))
            not_request(c, 0);
        return 0;
    }
    /* origin-form '/', asterisk-form '*', absolute-form (a scheme), authority-form (CONNECT) */
    if (!(ch == '/' || ch == '*' || alpha ||
          (kind == M_CONNECT && ((ch >= '0' && ch <= '9') || ch == '[')))) {
        not_request(c, ch);
        return 0;
    }
    int z = 0;
    struct http_record *tmpl = zero_rec.lookup(&z);
    if (!tmpl)
        return 0;
    u64 bit = 1ULL << (seq & 63);
    c->head_bits = kind == M_HEAD ? c->head_bits | bit : c->head_bits & ~bit;
    c->connect_bits = kind == M_CONNECT ? c->connect_bits | bit : c->connect_bits & ~bit;
    u32 mlen = m->nlen;
    u64 method0 = *(u64 *)&m->name[0], method1 = *(u64 *)&m->name[8];
    c->tail = seq + 1;
    c->rq_scanned = mlen + 2;
    c->rq_tpraw = 0;
    reset_parser(m, P_PATH);
    s->off = i + 1;

    struct http_record *rec = 0;
    c->ghost_bits |= bit;
    if (seq - c->head >= MAX_PENDING) {
        count(CNT_PIPELINE_SLOTS_FULL);
    } else {
        rec = h1_new_record(s->sk, c, seq, tmpl);
        if (rec)
            c->ghost_bits &= ~bit;
        else
            count(CNT_REQUEST_STATE_LOST);
    }
    if (!rec) {
        /* framed, never emitted: only what the scanners read needs a clean start */
        rec = ghost_record(s->sk);
        if (!rec)
            return 0;
        rec->flags = 0;
        rec->path_len = 0;
        rec->tp_len = 0;
        rec->tp_count = 0;
    } else {
        rec->read_ns = c->rq_start_ns;
        rec->arrival_ns = c->rq_arrival_ns;
        open_record(s, c, rec, seq);
        /* the method token: only tchar bytes reach here (request_start checked each) */
        rec->method_len = mlen;
        *(u64 *)&rec->method[0] = mlen < 8 ? LOW(method0, mlen) : method0;
        *(u64 *)&rec->method[8] = mlen <= 8 ? 0 : mlen < 16 ? LOW(method1, mlen - 8) : method1;
        if (kind == M_OTHER || kind == M_PRI)
            rec->flags |= REQF_METHOD_OTHER;
        rec->req_bytes = mlen + 1;
    }
    c->flags |= CONN_SEEN_REQ;     /* also when this one is a ghost: the next is not first */
    /* the target's first byte */
    rec->req_bytes += 1;
    if (ch == '/') {
        path_add(rec, '/');
    } else if (ch == '*') {
        path_add(rec, '*');
        m->state = P_LINE_REST;
    } else if (kind == M_CONNECT) {
        m->state = P_LINE_REST;                 /* host:port is no path */
    } else {
        rec->flags |= REQF_TARGET_ABS;
        m->state = P_ABS_SCHEME;
    }
    return rec;
}

/* The request line up to the target's first byte, before any record exists: leading empty
 * lines, the method token, SP. Returns STEP_NEXT with s->off at the target's first byte (the
 * caller opens the request), STEP_STOP, STEP_RELOAD, or STEP_GO when this program's share of
 * steps ran out. */
static __always_inline int request_start(struct scratch *s, struct conn *c)
{
    struct hparse *m = &c->rq;
#pragma clang loop unroll(disable)
    for (int k = 0; k < HTTP_METHOD_MAX + 4; k++) {
        u32 i = VLD(s->off);
        if (i >= s->total)
            return STEP_STOP;
        if (!visible(s, i))
            return STEP_RELOAD;
        u8 ch = BYTE(i);
        u8 st = VLD(m->state);
        if (st == P_TARGET)
            return STEP_NEXT;
        if (st == P_IDLE) {
            if (ch == '\r' || ch == '\n') {     /* empty lines before a request: ignored */
                s->off = i + 1;
                continue;
            }
            if (!is_tchar(ch))
                return not_request(c, ch);
            c->rq_start_ns = s->now;
            c->rq_arrival_ns = s->arrival;
            m->nlen = 0;
            m->state = P_METHOD;
        }
        u8 n = m->nlen;
        if (ch == ' ' && n > 0) {
            m->state = P_TARGET;
        } else {
            if (!is_tchar(ch) || n >= HTTP_METHOD_MAX)
                return not_request(c, ch);
            m->name[n] = ch;
            m->nlen = n + 1;
        }
        s->off = i + 1;
    }
    return STEP_GO;
}

/* The header section ended: frame the body (RFC 9112 6.3). */
static __always_inline int request_headers_end(struct conn *c, struct http_record *rec)
{
    struct hparse *p = &c->rq;
    u8 fr = p->fr;
    rec->flags |= REQF_HDR_DONE;
    if (fr & FR_TE) {
        /* Transfer-Encoding overrides Content-Length; a request whose final coding is not
         * chunked cannot be framed (the server must answer 400 and close). */
        if ((fr & FR_TE_BAD) || !(fr & FR_TE_CHUNKED)) {
            untrust(c, CNT_UNTRUSTED_TRANSFER_ENCODING);
            return STEP_STOP;
        }
        p->state = P_CHUNK_SIZE;
        p->len = 0;
        p->sub = 0;
        return STEP_GO;
    }
    if (fr & FR_CL_BAD) {
        untrust(c, CNT_UNTRUSTED_CONTENT_LENGTH);
        return STEP_STOP;
    }
    if ((fr & FR_CL) && p->len) {
        p->state = P_BODY;
        return STEP_GO;
    }
    return STEP_NEXT;
}

static __always_inline int step_req(struct scratch *s, struct conn *c, struct http_record *rec)
{
    struct hparse *p = &c->rq;
    u32 i = VLD(s->off);
    u8 st = VLD(p->state);
    if (i >= s->total || st == P_DEAD)
        return STEP_STOP;
    if (in_body(st))
        return body_step(s, p, i, &rec->req_bytes);
    if (!visible(s, i))
        return STEP_RELOAD;
    u32 scanned = c->rq_scanned;
    if (scanned >= HDR_LIMIT) {
        untrust(c, CNT_UNTRUSTED_HEADERS_TOO_LONG);
        return STEP_STOP;
    }
    int in_window = scanned < HDR_WINDOW;
    if (!in_window)
        rec->flags |= REQF_TP_WINDOW;
    /* fast paths, 8 bytes a step: a skipped line (to its end), the path, the traceparent
     * value; a header name's first 8 at once */
    int adv = -1;
    if (st == P_LINE_REST || st == P_SKIP_LINE)
        adv = skip_line_word(s, p, i);
    else if (st == P_LINE_START && !(p->hdr == H_TP && in_window))
        adv = name_word(s, p, i);
    else if (st == P_PATH)
        adv = path_word(s, rec, i);
    else if ((st == P_TP_OWS || st == P_TP_VALUE) && scanned + 8 <= HDR_WINDOW)
        adv = tp_word(s, c, rec, i);
    if (adv >= 0) {
        s->off = i + adv;
        c->rq_scanned = scanned + adv;
        rec->req_bytes += adv;
        return STEP_GO;
    }
    u8 ch = BYTE(i);
    s->off = i + 1;
    c->rq_scanned = scanned + 1;
    rec->req_bytes += 1;
    int ret = STEP_GO;
    if (st == P_PATH || st == P_PARAM) {
        if (ch == ' ' || ch == '?' || ch == '#' || ch == '\r') {
            p->state = P_LINE_REST;             /* the query is never copied */
        } else if (ch == '\n') {
            p->state = P_LINE_START;
        } else if (ch == ';') {
            p->state = P_PARAM;                 /* ";jsessionid=..." and kin: not copied */
            rec->flags |= REQF_PATH_PARAMS;
        } else if (st == P_PATH || ch == '/') {
            path_add(rec, ch);
            p->state = P_PATH;
        }
    } else if (st == P_ABS_SCHEME) {
        if (ch == ':') {
            p->state = P_ABS_SLASH;
            p->sub = 0;
        } else if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                     (ch >= '0' && ch <= '9') || ch == '+' || ch == '-' || ch == '.')) {
            p->state = ch == '\n' ? P_LINE_START : P_LINE_REST;    /* not a URI: no path */
        }
    } else if (st == P_ABS_SLASH) {
        if (ch != '/')
            p->state = ch == '\n' ? P_LINE_START : P_LINE_REST;
        else if (++p->sub == 2)
            p->state = P_ABS_AUTH;
    } else if (st == P_ABS_AUTH) {
        /* userinfo, host and port are skipped; the path starts at the first '/' */
        if (ch == '/') {
            path_add(rec, '/');
            p->state = P_PATH;
        } else if (ch == ' ' || ch == '?' || ch == '#' || ch == '\r') {
            path_add(rec, '/');                 /* an empty path is "/" (RFC 9112 3.2.2) */
            p->state = P_LINE_REST;
        } else if (ch == '\n') {
            p->state = P_LINE_START;
        }
    } else if (st == P_LINE_REST || st == P_SKIP_LINE) {
        if (ch == '\n')
            p->state = P_LINE_START;
    } else if (st == P_LINE_START) {
        if ((ch == ' ' || ch == '\t') && p->hdr == H_TP && in_window) {
            /* obs-fold of the traceparent line: the value goes on after a space (RFC 9112 5.2) */
            u32 pos = c->rq_tpraw;
            if (pos < TP_CAP)
                rec->tp[pos] = ' ';
            if (pos < 0xffff)
                c->rq_tpraw = pos + 1;
            p->state = P_TP_VALUE;
        } else if (line_start_byte(p, ch) == STEP_HDR_END) {
            ret = request_headers_end(c, rec);
        }
    } else if (st == P_CR) {
        if (ch == '\n')
            ret = request_headers_end(c, rec);
        else
            p->state = P_SKIP_LINE;             /* a bare CR */
    } else if (st == P_NAME) {
        if (name_byte(p, ch) == H_TP) {
            if (in_window && rec->tp_count < 255)
                rec->tp_count++;
            p->state = (in_window && rec->tp_count == 1) ? P_TP_OWS : P_SKIP_LINE;
        }
    } else if (st == P_TP_OWS || st == P_TP_VALUE) {
        if (ch == '\r') {
            p->state = P_SKIP_LINE;
        } else if (ch == '\n') {
            p->state = P_LINE_START;
        } else if (!in_window) {
            p->state = P_SKIP_LINE;             /* the value runs past the window */
        } else if (st == P_TP_OWS && (ch == ' ' || ch == '\t')) {
            /* optional whitespace before the value */
        } else {
            p->state = P_TP_VALUE;
            u32 pos = c->rq_tpraw;
            if (pos < TP_CAP)
                rec->tp[pos] = ch;
            if (pos < 0xffff)
                c->rq_tpraw = pos + 1;
            if (ch != ' ' && ch != '\t')
                rec->tp_len = c->rq_tpraw;
        }
    } else if (st == P_CL_VALUE) {
        cl_byte(p, ch);
    } else if (st == P_TE_VALUE) {
        te_byte(p, ch);
    }
    return ret;
}

/* A request ended (its body too): the next byte starts another. TE + CL was framed by TE, but
 * the server must close after answering it, and one that framed it by CL would see different
 * requests than we do: nothing after it is trusted. */
static __always_inline void request_done(struct conn *c)
{
    struct hparse *p = &c->rq;
    if ((p->fr & FR_TE) && (p->fr & (FR_CL | FR_CL_BAD))) {
        untrust(c, CNT_UNTRUSTED_TE_AND_CL);
        return;
    }
    reset_parser(p, P_IDLE);
}

/* bpf_loop callback of scan_req: LOOP_STEPS steps of the request scan_req found or opened.
 * 1 stops the loop; the scan's step result says why. */
int scan_req_steps(struct loop_arg a)
{
    struct scan_loop *l = a.ctx;
    struct scratch *s = l->s;
    int r = STEP_GO;
#pragma unroll 1
    for (int k = 0; k < LOOP_STEPS; k++) {
        r = step_req(s, l->c, l->rec);
        if (r != STEP_GO)
            break;
    }
    s->step = r;
    return r != STEP_GO;
}

int scan_req(void *ctx)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    if (!s)
        return 0;
    u64 sk = s->sk;
    struct conn *c = conns.lookup(&sk);
    if (!c || (c->flags & (CONN_IGNORED | CONN_UNTRUSTED)))
        return 0;
    if (!visible(s, s->off) && s->off < s->total && !skipping(c->rq.state))
        s->walk_more = load_window(s);
    int r = STEP_GO;
    int split = s->chain == 0 && c->rq.state == P_TP_VALUE;    /* the value spans reads */
    struct http_record *rec = 0;
    if (c->rq.state <= P_TARGET) {
        r = request_start(s, c);
        if (r != STEP_NEXT)
            goto out;
        r = STEP_GO;
        rec = open_request(s, c);
    } else {
        rec = current_request(s, c, c->tail - 1);
    }
    if (!rec)
        goto out;
    if (split)
        rec->flags |= REQF_TP_SPLIT;
    struct scan_loop l = {.s = s, .c = c, .rec = rec};
    s->step = STEP_GO;
    bpf_loop(SCAN_CHUNK / LOOP_STEPS, LOOP_CB(scan_req_steps), &l, 0);
    r = VLD(s->step);
    /* Once its headers ended the request's traceparent is final: whether a span will be made
     * of it is decided here, once per scan rather than at every emit() (bpf/http_conn.h) */
    if (rec->flags & REQF_HDR_DONE)
        rec->unspanned = unspanned(rec);
    if (r == STEP_NEXT)
        request_done(c);
    else if (r == STEP_BAD)
        untrust(c, CNT_UNTRUSTED_CHUNKED);
out:
    if (c->flags & (CONN_IGNORED | CONN_UNTRUSTED))
        return 0;
    if (c->flags & CONN_H2) {
        progs.call(ctx, PROG_H2_RD);            /* HTTP/2 from the preface on */
        h2_not_loaded(c);
        return 0;
    }
    if (r == STEP_STOP || s->off >= s->total)
        return 0;
    /* STEP_RELOAD at a window that could not be loaded: these bytes cannot be seen */
    if (r == STEP_RELOAD && s->base == s->off && s->n == 0 && !s->walk_more) {
        untrust(c, CNT_UNTRUSTED_UNSCANNED);
        return 0;
    }
    if (s->chain < CHAIN_MAX) {
        s->chain++;
        progs.call(ctx, PROG_SCAN_REQ);
    }
    untrust(c, CNT_UNTRUSTED_UNSCANNED);        /* out of tail calls with bytes to frame */
    return 0;
}
