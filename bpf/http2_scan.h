/* HTTP/2 frames and HPACK, one record per stream (tail calls PROG_H2_RD, PROG_H2_WR,
 * PROG_H2_END). Part of the bpf/http.c compile unit; state and maps in http2_conn.h.
 *
 * Frames (RFC 9113 section 4) are walked across reads and writes of any size, as the HTTP/1.x
 * scanners walk messages: DATA and every payload we do not need are skipped by count, never
 * copied. Header blocks (HEADERS, CONTINUATION, PUSH_PROMISE) go through an HPACK decoder
 * (RFC 7541) that keeps its state across frames and reads, so a block split anywhere, or
 * continued by CONTINUATION frames, decodes the same. It copies only the values of :method,
 * :path (up to its query: see h2_str_byte), traceparent, :status and grpc-status; every other
 * name and value is skipped by count. Huffman-coded strings are copied as they are (user space
 * decodes them: agent/core/hpack.py); :status and grpc-status, digits only, are decoded here.
 *
 * The dynamic table is followed by insertion number: index 62 + k is insertion (ins - 1 - k),
 * whatever was evicted, so no entry sizes are needed. For the newest H2_KINDS insertions the
 * kind of field is kept, and the values of the ones we need are kept in `h2dyn`. A reference we
 * cannot resolve is counted by reason and flagged on the record (H2F_UNRESOLVED), never guessed.
 */

/* Decoder steps per program before tail-calling the next for the rest of a read or write, taken
 * H2_LOOP_STEPS at a time by a bpf_loop callback (bpf/http.c: LOOP_CB), so the verifier walks
 * one callback, not every step (a step is ~20k instructions processed). Everything a step
 * depends on is re-read from map memory (VLD), so the verifier sees the same state at every
 * loop head and prunes. */
#define H2_STEPS 30             /* decoder steps per program */
#define H2_LOOP_STEPS 1         /* ... per bpf_loop callback (h2_steps_rd, h2_steps_wr) */

/* step results beyond STEP_* (http_scan.h) */
#define H2_REC 16               /* a header block started: look its record up */
#define H2_END 17               /* streams ended (or a flush is due): run PROG_H2_END */
#define H2_NOT_H2 18            /* an upgrade that is not HTTP/2: leave the connection alone */
#define H2_BAD_HPACK 19         /* an HPACK block we cannot decode */

/* frame types and flags */
#define FT_DATA 0
#define FT_HEADERS 1
#define FT_PRIORITY 2
#define FT_RST 3
#define FT_SETTINGS 4
#define FT_PUSH 5
#define FT_PING 6
#define FT_GOAWAY 7
#define FT_WINDOW 8
#define FT_CONT 9
#define FL_END_STREAM 0x01
#define FL_END_HEADERS 0x04
#define FL_PADDED 0x08
#define FL_PRIORITY 0x20

/* The names we look for, as literals and as their (unique) Huffman codes (RFC 7541 Appendix B,
 * EOS-padded; tests/test_hpack.py checks these words against agent/core/hpack.py). */
#define HUFF_TRACEPARENT 0x3fa9851d6b21834dULL     /* 4d 83 21 6b 1d 85 a9 3f */
#define HUFF_GRPC_STATUS 0x8fda3412b2c8ca9aULL     /* 9a ca c8 b2 12 34 da 8f */
/* pseudo-header names, for an encoder that sends them as literals (gRPC core does for :path) */
#define HUFF_PATH 0x3fd358b9ULL                     /* b9 58 d3 3f */
#define HUFF_METHOD 0xe4395349b9ULL                 /* b9 49 53 39 e4 */
#define HUFF_STATUS 0xa3368d84b8ULL                 /* b8 84 8d 36 a3 */

static __always_inline u8 preface_byte(u32 k)
{
    u64 w = k < 8 ? word8("PRI * HT") : k < 16 ? word8("TP/2.0\r\n") : word8("\r\nSM\r\n\r\n");
    return w >> (8 * (k & 7));
}

/* Queue stream `sid` to be emitted by PROG_H2_END; H2_END when the queue is full. */
static __always_inline int h2_push_end(struct h2end *e, u32 sid, u16 why)
{
    u32 n = e->n;
    if (n < H2_ENDS) {
        e->sid[n & (H2_ENDS - 1)] = sid;
        e->why[n & (H2_ENDS - 1)] = why;
        e->n = n + 1;
    }
    return n + 1 >= H2_ENDS ? H2_END : STEP_GO;
}

/* The record header-block fields go to: the stream's, or the ghost record (an untracked
 * stream, a response to a stream we never saw open, PUSH_PROMISE): its values still feed the
 * dynamic table, and it is never emitted. Not counted here: an untracked stream was counted
 * when it was not opened (h2_open), and a tracked one whose record is gone is counted once,
 * when its slot is freed (h2_finish). */
static __always_inline struct http_record *h2_block_rec(struct scratch *s, struct h2dir *d)
{
    if (!d->ghost) {
        struct req_key key = {.sk = s->sk, .seq = d->bsid};
        struct http_record *rec = reqs.lookup(&key);
        if (rec)
            return rec;
        d->ghost = 1;
    }
    return ghost_record(s->sk);
}

/* The client's first HEADERS frame of stream `sid`: open its record. */
static __always_inline void h2_open(struct scratch *s, struct conn *c, struct h2conn *hc,
                                    struct h2dir *d, u32 sid)
{
    d->ghost = 1;
    if (sid <= hc->last_sid) {
        /* trailers of a stream still open (or of one already ended: ghost) */
        struct req_key key = {.sk = s->sk, .seq = sid};
        d->ghost = !reqs.lookup(&key);
        return;
    }
    hc->last_sid = sid;
    u32 slot = (sid >> 1) & (H2_STREAMS - 1);
    if (hc->open[slot]) {
        count(CNT_H2_STREAMS_FULL);
        return;
    }
    int z = 0;
    struct http_record *tmpl = zero_rec.lookup(&z);
    struct req_key key = {.sk = s->sk, .seq = sid};
    if (!tmpl || reqs.update(&key, tmpl) != 0) {
        count(CNT_REQUEST_STATE_LOST);
        return;
    }
    struct http_record *rec = reqs.lookup(&key);
    if (!rec)
        return;
    rec->h2_flags = H2F_STREAM;
    rec->req_bytes = d->left + 9;       /* its HEADERS frame (h2_frame ran before it existed) */
    rec->read_ns = s->now;
    rec->arrival_ns = s->arrival;
    open_record(s, c, rec, sid);
    hc->open[slot] = sid;
    hc->nopen++;
    d->ghost = 0;
}

/* A frame header was read. Returns STEP_GO, H2_REC (a header block starts), H2_END, STEP_BAD
 * (not a valid frame here) or H2_NOT_H2. */
static __always_inline int h2_frame(struct scratch *s, struct conn *c, struct h2conn *hc,
                                    struct h2dir *d, struct h2end *e, int dir, u32 len, u8 type,
                                    u8 fl, u32 sid)
{
    d->ftype = type;
    d->fflags = fl;
    d->sid = sid;
    d->left = len;
    d->padleft = 0;
    d->pre = 0;
    d->fstate = F_SKIP;
    if (!d->settings_seen) {
        /* each side's connection preface ends with (server: is) a SETTINGS frame */
        if (type != FT_SETTINGS || sid)
            return hc->upgraded ? H2_NOT_H2 : STEP_BAD;
        d->settings_seen = 1;
    }
    if (d->block && (type != FT_CONT || sid != d->bsid))
        return STEP_BAD;                /* a header block must go on in CONTINUATION frames */
    int ret = STEP_GO;
    if (type == FT_HEADERS || type == FT_PUSH || type == FT_CONT) {
        if (!sid || (type == FT_CONT && !d->block) || (type == FT_PUSH && dir == DIR_RD))
            return STEP_BAD;
        u8 pre = 0;
        if (type != FT_CONT) {
            pre = (fl & FL_PADDED) ? 1 : 0;
            if (type == FT_HEADERS && (fl & FL_PRIORITY))
                pre += 5;
            if (type == FT_PUSH)
                pre += 4;               /* the promised stream id */
            if (len < pre)
                return STEP_BAD;
            d->bsid = sid;
            d->hs = HS_REP;
            d->inc = 0;                 /* with END_STREAM the stream ends with the block */
            d->endafter = type == FT_HEADERS && (fl & FL_END_STREAM);
            if (type == FT_PUSH)
                d->ghost = 1;           /* the request it promises: values feed the table only */
            else if (dir == DIR_RD)
                d->opening = 1;         /* the scan loop opens it (h2_open: once per program) */
            else
                d->ghost = 0;
            ret = H2_REC;
        }
        d->block = !(fl & FL_END_HEADERS);
        d->pre = pre;
        d->fstate = pre ? F_PRE : F_BLOCK;
    } else if (type == FT_DATA) {
        if (!sid)
            return STEP_BAD;
    } else if (type == FT_RST || type == FT_WINDOW) {
        if (len != 4 || (type == FT_RST && !sid))
            return STEP_BAD;
        if (type == FT_RST)
            ret = h2_push_end(e, sid, H2F_RST);
    } else if (type == FT_PRIORITY) {
        if (len != 5 || !sid)
            return STEP_BAD;
    } else if (type == FT_SETTINGS) {
        if (sid || len % 6)
            return STEP_BAD;
    } else if (type == FT_PING) {
        if (sid || len != 8)
            return STEP_BAD;
    } else if (type == FT_GOAWAY) {
        if (sid || len < 8)
            return STEP_BAD;
        d->pre = 4;                     /* the last stream id, read into num */
        d->num = 0;
        d->fstate = F_PRE;
    }
    /* bytes of the stream's messages, and where its response starts and ends */
    if (sid && (type == FT_DATA || type == FT_HEADERS || type == FT_CONT)) {
        struct req_key key = {.sk = s->sk, .seq = sid};
        struct http_record *rec = reqs.lookup(&key);
        if (rec && (rec->h2_flags & H2F_STREAM)) {
            if (dir == DIR_RD) {
                rec->req_bytes += len + 9;
            } else {
                rec->resp_bytes += len + 9;
                if (!rec->resp_start_ns)
                    rec->resp_start_ns = s->now;
                if (type == FT_DATA && (fl & FL_END_STREAM))
                    ret = h2_push_end(e, sid, 0);
            }
        }
    }
    return ret;                         /* DATA padding is skipped with its payload */
}

/* The current frame's payload is used up. */
static __always_inline int h2_frame_done(struct h2dir *d, struct h2end *e, int dir,
                                         struct http_record *rec)
{
    d->fstate = F_HDR;
    d->hgot = 0;
    u8 t = d->ftype;
    if ((t == FT_HEADERS || t == FT_CONT || t == FT_PUSH) && !d->block) {
        if (d->hs != HS_REP)
            return H2_BAD_HPACK;        /* a field cut by the end of its block */
        if (dir == DIR_RD && t != FT_PUSH && !d->ghost)
            rec->flags |= REQF_HDR_DONE;    /* its traceparent, if any, has been seen */
        if (dir == DIR_WR && d->endafter && !d->ghost)
            return h2_push_end(e, d->bsid, 0);      /* HEADERS with END_STREAM: trailers */
    }
    return STEP_GO;
}

/* ------------------------------------------------------------------------- HPACK fields */

/* What a static-table entry (RFC 7541 Appendix A) is to us. */
static __always_inline u8 static_kind(u32 idx)
{
    if (idx == 2 || idx == 3)
        return K_METHOD;
    if (idx == 4 || idx == 5)
        return K_PATH;
    if (idx >= 8 && idx <= 14)
        return K_STATUS;
    return K_OTHER;
}

static __always_inline void h2_set_tp(struct http_record *rec, const u8 *val, u32 len, u32 full,
                                      u8 huff)
{
    if (rec->tp_count < 255)
        rec->tp_count++;
    if (rec->tp_count != 1)
        return;                         /* only the first is copied; user space rejects two */
    __builtin_memcpy(rec->tp, val, TP_CAP);
    rec->tp_len = full;
    if (huff)
        rec->h2_flags |= H2F_TP_HUFF;
}

/* Apply a dynamic-table entry (a fully indexed field) to the record. */
static __always_inline void h2_apply(struct http_record *rec, struct h2dyn *v)
{
    u8 k = v->kind;
    if (k == K_TP) {
        h2_set_tp(rec, v->val, v->len, v->full, v->huff);
    } else if (k == K_PATH) {
        __builtin_memcpy(rec->path, v->val, HTTP_PATH_MAX);
        rec->path_len = v->len;
        if (v->trunc)
            rec->flags |= REQF_PATH_TRUNC;
        if (v->huff)
            rec->h2_flags |= H2F_PATH_HUFF;
    } else if (k == K_METHOD) {
        __builtin_memcpy(rec->method, v->val, HTTP_METHOD_MAX);
        rec->method_len = v->len < HTTP_METHOD_MAX ? v->len : HTTP_METHOD_MAX;
        if (v->huff)
            rec->h2_flags |= H2F_METHOD_HUFF;
    } else if (k == K_STATUS) {
        if (v->num != 0xffff && rec->status < 200)
            rec->status = v->num;
    } else if (k == K_GRPC_STATUS) {
        if (v->num < 255)
            rec->grpc_status = v->num + 1;
    }
}

/* A fully indexed static field we need. */
static __always_inline void h2_static(struct http_record *rec, u32 idx)
{
    if (idx == 2 || idx == 3) {
        *(u64 *)&rec->method[0] = idx == 2 ? word8("GET\0\0\0\0\0") : word8("POST\0\0\0\0");
        rec->method_len = idx == 2 ? 3 : 4;
    } else if (idx == 4 || idx == 5) {
        *(u64 *)&rec->path[0] = idx == 4 ? word8("/\0\0\0\0\0\0\0") : word8("/index.h");
        *(u64 *)&rec->path[8] = idx == 4 ? 0 : word8("tml\0\0\0\0\0");
        rec->path_len = idx == 4 ? 1 : 11;
    } else if (idx >= 8 && idx <= 14 && rec->status < 200) {
        rec->status = idx == 8 ? 200 : idx == 9 ? 204 : idx == 10 ? 206 : idx == 11 ? 304 :
                      idx == 12 ? 400 : idx == 13 ? 404 : 500;
    }
}

/* Dynamic index k (0: the newest entry) of this direction: its kind, and its value when we
 * hold it. Returns the kind; *v is set when the value is held. */
static __always_inline u8 h2_dyn(struct h2conn *hc, struct h2dir *d, int dir, u32 k,
                                 struct http_record *rec, struct h2dyn **v)
{
    *v = 0;
    if (k >= d->ins)
        return 0xff;                    /* past the table's end: not valid HPACK */
    u32 n = d->ins - 1 - k;
    struct h2dyn_key key = {.conn_id = hc->conn_id, .ins = n, .dir = dir};
    u8 kind = K_OTHER;
    if (k < H2_KINDS) {
        kind = d->kinds[n & (H2_KINDS - 1)];
        if (kind == K_OTHER)
            return K_OTHER;
        *v = h2dyn.lookup(&key);
        if (!*v) {
            count(CNT_H2_DYN_UNRESOLVED);
            rec->h2_flags |= H2F_UNRESOLVED;
        }
        return kind;
    }
    /* older than the kinds we keep (a table larger than 4 KiB): the value map may still hold it */
    *v = h2dyn.lookup(&key);
    if (*v)
        return (*v)->kind;
    count(CNT_H2_DYN_BEYOND);
    rec->h2_flags |= H2F_UNRESOLVED;
    return K_OTHER;
}

/* The string being read is a value of kind d->kind: start it. */
static __always_inline void h2_value_start(struct h2dir *d, struct http_record *rec)
{
    u8 k = d->kind;
    d->num = 0;
    d->hbits = 0;
    d->hnb = 0;
    d->numbad = 0;
    if (k == K_TP) {
        if (rec->tp_count < 255)
            rec->tp_count++;
        if (rec->tp_count != 1) {
            d->kind = K_OTHER;          /* only the first is copied; user space rejects two */
            d->numbad |= 4;             /* ... and the table entry has no value */
            return;
        }
        rec->tp_len = d->slen < 0xffff ? d->slen : 0xffff;
        if (d->huff)
            rec->h2_flags |= H2F_TP_HUFF;
    } else if (k == K_PATH) {
        rec->path_len = 0;
        d->qmin = 0xff;                 /* no 1-bits carried in: only 0xff completes a run */
        rec->flags &= ~REQF_PATH_TRUNC;
        if (d->huff)
            rec->h2_flags |= H2F_PATH_HUFF;
        else
            rec->h2_flags &= ~H2F_PATH_HUFF;
        if (d->huff && d->slen > HTTP_PATH_MAX)
            rec->flags |= REQF_PATH_TRUNC;  /* the decoded prefix is kept */
    } else if (k == K_METHOD) {
        rec->method_len = 0;
        if (d->huff)
            rec->h2_flags |= H2F_METHOD_HUFF;
        else
            rec->h2_flags &= ~H2F_METHOD_HUFF;
    }
}

/* One byte of a decimal value, literal or Huffman-coded: digits are the 5-bit codes 0-2 and
 * the 6-bit codes 0x19-0x1f; anything else makes the value invalid (numbad). */
/* One Huffman-coded digit from the top of the nb bits held in `bits` (RFC 7541 Appendix B: '0'
 * to '2' are 5 bits, '3' to '9' 6), added to d->num; 0 when there is none to take yet, or the
 * next code is not a digit. */
static __always_inline int h2_huff_digit(struct h2dir *d, u32 bits, u32 *nb)
{
    if (*nb < 5 || *nb > 24)
        return 0;
    u32 top5 = (bits >> (*nb - 5)) & 0x1f;
    u32 digit;
    if (top5 < 3) {
        digit = top5;
        *nb -= 5;
    } else if (top5 >= 0xc && top5 <= 0xf) {
        if (*nb < 6)
            return 0;
        u32 top6 = (bits >> (*nb - 6)) & 0x3f;
        if (top6 < 0x19) {
            d->numbad |= 1;
            return 0;
        }
        digit = top6 - 0x19 + 3;
        *nb -= 6;
    } else {
        if (top5 != 0x1f)
            d->numbad |= 1;         /* not a digit (all ones: the EOS padding, checked at the end) */
        return 0;
    }
    if (d->num < 10000)
        d->num = d->num * 10 + digit;
    return 1;
}

static __always_inline void h2_num_byte(struct h2dir *d, u8 b)
{
    if (!d->huff) {
        if (b >= '0' && b <= '9' && d->num < 10000)
            d->num = d->num * 10 + (b - '0');
        else
            d->numbad |= 1;
        return;
    }
    u32 bits = (d->hbits << 8) | b;
    u32 nb = d->hnb + 8;
    /* every digit the held bits complete, at most 3: three calls, not a `#pragma unroll` loop,
     * which BCC's optimiser (the only one since -disable-llvm-passes) cannot unroll */
    if (h2_huff_digit(d, bits, &nb) && h2_huff_digit(d, bits, &nb))
        h2_huff_digit(d, bits, &nb);
    if (nb > 24)
        nb = 24;
    d->hbits = bits & ((1U << nb) - 1);
    d->hnb = nb;
}

/* A value string ended: the field is complete. */
static __always_inline void h2_field_done(struct h2conn *hc, struct h2dir *d, int dir,
                                          struct http_record *rec)
{
    u8 k = d->kind;
    u8 ik = d->ikind;
    int numok = !(d->numbad & 5) && d->spos > 0 &&
                (!d->huff || (d->hnb < 8 && d->hbits == (1U << d->hnb) - 1));
    if (k == K_STATUS && numok && rec->status < 200)
        rec->status = d->num;
    else if (k == K_GRPC_STATUS && numok && d->num < 255)
        rec->grpc_status = d->num + 1;
    d->hs = HS_REP;
    if (!d->inc)
        return;
    /* literal with incremental indexing: the table gains an entry */
    u32 n = d->ins;
    d->ins = n + 1;
    d->kinds[n & (H2_KINDS - 1)] = ik;
    if (ik == K_OTHER || (d->numbad & 4))
        return;
    struct h2dyn v = {};
    v.kind = ik;
    v.huff = d->huff;
    v.full = d->spos < 0xffff ? d->spos : 0xffff;
    if (ik == K_TP) {
        __builtin_memcpy(v.val, rec->tp, TP_CAP);
        v.len = d->spos < TP_CAP ? d->spos : TP_CAP;
    } else if (ik == K_PATH) {
        __builtin_memcpy(v.val, rec->path, HTTP_PATH_MAX);
        v.len = rec->path_len;
        v.trunc = !!(rec->flags & REQF_PATH_TRUNC);
    } else if (ik == K_METHOD) {
        __builtin_memcpy(v.val, rec->method, HTTP_METHOD_MAX);
        v.len = rec->method_len;
    } else {
        v.num = numok ? d->num : 0xffff;
    }
    struct h2dyn_key key = {.conn_id = hc->conn_id, .ins = n, .dir = dir};
    h2dyn.update(&key, &v);
}

/* The name or value string being read ended. */
static __always_inline int h2_str_done(struct h2conn *hc, struct h2dir *d, int dir,
                                       struct http_record *rec)
{
    if (d->phase == PH_VALLEN) {
        h2_field_done(hc, d, dir, rec);
        return STEP_GO;
    }
    /* a literal name (names are lowercase): traceparent and grpc-status are 11 bytes as sent,
     * 8 Huffman-coded; :path 5 (4), :method and :status 7 (5) */
    u8 kind = K_OTHER;
    u32 n = d->spos;
    u64 w0 = d->name0, w1 = d->name1;
    if (d->kind != K_OTHER) {
        if (d->huff && n == 8) {
            kind = w0 == HUFF_TRACEPARENT ? K_TP : w0 == HUFF_GRPC_STATUS ? K_GRPC_STATUS : K_OTHER;
        } else if (d->huff && n == 4) {
            kind = w0 == HUFF_PATH ? K_PATH : K_OTHER;
        } else if (d->huff && n == 5) {
            kind = w0 == HUFF_METHOD ? K_METHOD : w0 == HUFF_STATUS ? K_STATUS : K_OTHER;
        } else if (!d->huff && n == 5) {
            kind = w0 == LOW(word8(":path\0\0\0"), 5) ? K_PATH : K_OTHER;
        } else if (!d->huff && n == 7) {
            kind = w0 == LOW(word8(":method\0"), 7) ? K_METHOD :
                   w0 == LOW(word8(":status\0"), 7) ? K_STATUS : K_OTHER;
        } else if (!d->huff && n == 11) {
            if (w0 == word8("tracepar") && w1 == LOW(word8("ent\0\0\0\0\0"), 3))
                kind = K_TP;
            else if (w0 == word8("grpc-sta") && w1 == LOW(word8("tus\0\0\0\0\0"), 3))
                kind = K_GRPC_STATUS;
        }
    }
    d->kind = kind;
    d->ikind = kind;
    d->phase = PH_VALLEN;
    d->hs = HS_STRLEN;
    return STEP_GO;
}

/* An HPACK integer (RFC 7541 5.1) is complete in d->ival. */
static __always_inline int h2_int_done(struct h2conn *hc, struct h2dir *d, int dir,
                                       struct http_record *rec)
{
    u8 ph = d->phase;
    u32 v = d->ival;
    if (ph == PH_SIZE) {
        d->hs = HS_REP;
        return STEP_GO;
    }
    if (ph == PH_IDX || ph == PH_NAMEIDX) {
        if (v == 0 && ph == PH_IDX)
            return H2_BAD_HPACK;        /* index 0 is not valid */
        u8 kind = K_OTHER;
        struct h2dyn *dv = 0;
        if (v == 0) {                   /* a literal name follows */
            d->phase = PH_NAMELEN;
            d->hs = HS_STRLEN;
            return STEP_GO;
        }
        if (v <= 61) {
            kind = static_kind(v);
            if (ph == PH_IDX && kind != K_OTHER)
                h2_static(rec, v);
        } else {
            kind = h2_dyn(hc, d, dir, v - 62, rec, &dv);
            if (kind == 0xff)
                return H2_BAD_HPACK;
            if (ph == PH_IDX && dv)
                h2_apply(rec, dv);
        }
        if (ph == PH_IDX) {
            d->hs = HS_REP;
            return STEP_GO;
        }
        d->kind = kind;
        d->ikind = kind;
        d->phase = PH_VALLEN;
        d->hs = HS_STRLEN;
        return STEP_GO;
    }
    /* a string length */
    d->slen = v;
    d->spos = 0;
    d->hs = HS_STR;
    if (ph == PH_NAMELEN) {
        d->name0 = 0;
        d->name1 = 0;
        d->kind = v <= 16 ? K_TP : K_OTHER;     /* K_TP here: "collect the name bytes" */
    } else {
        h2_value_start(d, rec);
    }
    return STEP_GO;                     /* an empty string ends at the next step */
}

/* The first byte of an HPACK integer with an n-bit prefix holding v (max: all ones): true
 * when the integer is complete (d->ival). */
static __always_inline int h2_int_first(struct h2dir *d, u32 v, u32 max)
{
    d->ival = v;
    d->ishift = 0;
    d->hs = HS_INT;
    return v < max;
}

/* One byte of a :path value. */
static __always_inline void h2_path_byte(struct h2dir *d, struct http_record *rec, u8 b)
{
    u32 pl = rec->path_len;
    /* The query is never copied: the rest is skipped. A Huffman-coded '?' (1111111100) or
     * '#' (111111111010) cannot be seen without decoding, but both start with eight 1-bits,
     * which the code of '/', letters, digits, '.', '-', '_' or '%' never hold alone. So the
     * copy stops at the first byte in which a run of eight 1-bits completes, counting the
     * ones the previous byte ended with: the bytes kept hold at most the first 7 bits of
     * a '?', never a query byte. Some paths are cut early for it (a '9' before a 'w', an
     * 'X' or 'Z' after a 'v'): flagged truncated (docs/attributes.md). The byte completes
     * the run when its leading ones reach 8 minus those carried, that is when it is at
     * least qmin, the byte whose top (8 - carried) bits are ones. A last byte of all ones
     * is kept: a '?' or '#' completing its run there would need a 0 after it, so it is
     * the EOS padding after a code ending in ones ('e', 'o', '9', ...). */
    int query = d->huff ? b >= d->qmin && (b != 0xff || d->slen != 0)
                        : (b == '?' || b == '#');
    if (query) {
        d->kind = K_OTHER;
        if (d->huff)
            rec->flags |= REQF_PATH_TRUNC;  /* cut at what may be a '?' (user space cuts
                                             * what it decodes, partial) */
    } else if (pl < HTTP_PATH_MAX) {
        rec->path[pl] = b;
        rec->path_len = pl + 1;
    } else {
        rec->flags |= REQF_PATH_TRUNC;
    }
    /* the run this byte ends with: nb's lowest set bit is 1 << (trailing ones of b); the
     * next byte completes eight when its top (8 - trailing ones) bits are all set */
    u32 nb = ~b & 0xff;
    d->qmin = (0xff * (nb & -nb)) & 0xff;
}

/* One byte of a string we look at: a short name, or a value we copy or decode (a :path goes
 * its own step: h2_path_step). h2_step ends the string when slen reaches 0. */
static __always_inline void h2_str_byte(struct h2dir *d, struct http_record *rec, u8 b)
{
    u32 pos = d->spos;
    d->spos = pos + 1;
    d->slen -= 1;
    u8 k = d->kind;
    if (d->phase == PH_NAMELEN) {
        if (pos < 8)
            d->name0 |= (u64)b << (8 * pos);
        else if (pos < 16)
            d->name1 |= (u64)b << (8 * (pos & 7));
    } else if (k == K_TP) {
        if (pos < TP_CAP)
            rec->tp[pos] = b;
    } else if (k == K_METHOD) {
        if (pos < HTTP_METHOD_MAX) {
            rec->method[pos] = b;
            rec->method_len = pos + 1;
        }
    } else {
        h2_num_byte(d, b);
    }
}

/* One byte of a header block fragment: true when it completes an integer (d->ival). */
static __always_inline int h2_hpack_byte(struct h2dir *d, struct http_record *rec, u8 b)
{
    u8 hs = d->hs;
    if (hs == HS_REP) {
        d->inc = 0;
        if (b & 0x80) {                                 /* indexed field */
            d->phase = PH_IDX;
            return h2_int_first(d, b & 0x7f, 0x7f);
        }
        if ((b & 0xc0) == 0x40) {                       /* literal, incremental indexing */
            d->inc = 1;
            d->phase = PH_NAMEIDX;
            return h2_int_first(d, b & 0x3f, 0x3f);
        }
        if ((b & 0xe0) == 0x20) {                       /* dynamic table size update */
            d->phase = PH_SIZE;
            return h2_int_first(d, b & 0x1f, 0x1f);
        }
        d->phase = PH_NAMEIDX;                          /* literal, not indexed / never */
        return h2_int_first(d, b & 0x0f, 0x0f);
    }
    if (hs == HS_INT) {
        u8 sh = d->ishift;
        if (sh > 21) {
            d->numbad |= 8;             /* more than 2^28: no field of ours is that large */
            return 1;
        }
        d->ival += (u32)(b & 0x7f) << sh;
        d->ishift = sh + 7;
        return !(b & 0x80);
    }
    if (hs == HS_STRLEN) {
        d->huff = b >> 7;
        return h2_int_first(d, b & 0x7f, 0x7f);
    }
    h2_str_byte(d, rec, b);
    return 0;
}

/* The current frame's payload (padding excluded) is used up: skip its padding, or end it. */
static __always_inline int h2_payload_end(struct h2dir *d, struct h2end *e, int dir,
                                          struct http_record *rec)
{
    if (d->padleft) {
        d->left = d->padleft;
        d->padleft = 0;
        d->fstate = F_SKIP;
        return STEP_GO;
    }
    return h2_frame_done(d, e, dir, rec);
}

/* One byte before a header block (pad length, priority, promised id) or of GOAWAY's last id. */
static __always_inline int h2_pre_byte(struct h2dir *d, struct h2end *e, int dir, u8 b)
{
    d->pre -= 1;
    if (d->ftype == FT_GOAWAY) {
        d->num = (d->num << 8) | b;
        if (d->pre)
            return STEP_GO;
        d->fstate = F_SKIP;
        if (dir == DIR_RD)
            return STEP_GO;
        /* the server will not process streams above this one: they end now */
        e->flush = H2F_GOAWAY;
        e->flush_above = d->num & 0x7fffffff;
        e->cursor = 0;
        return H2_END;
    }
    if (d->fflags & FL_PADDED) {        /* the first byte: the pad length */
        d->fflags &= ~FL_PADDED;
        if (b > d->left)
            return STEP_BAD;
        d->padleft = b;
        d->left -= b;
    }
    if (!d->pre)
        d->fstate = F_BLOCK;
    return STEP_GO;
}

/* The 9-byte frame header at i (or its last byte, the rest gathered in hb[]). */
static __always_inline int h2_frame_header(struct scratch *s, struct conn *c, struct h2conn *hc,
                                           struct h2dir *d, struct h2end *e, int dir, u32 i)
{
    u32 at = i - s->base;
    u8 h[9];
    if (d->hgot == 0 && at + 9 <= s->n) {
        __builtin_memcpy(h, &s->buf[at & (SCRATCH_SIZE - 1)], 9);
        s->off = i + 9;
    } else {
        u8 g = d->hgot;
        if (g < 9)
            d->hb[g] = BYTE(i);
        d->hgot = g + 1;
        s->off = i + 1;
        if (g + 1 < 9)
            return STEP_GO;
        __builtin_memcpy(h, d->hb, 9);
    }
    u32 len = ((u32)h[0] << 16) | ((u32)h[1] << 8) | h[2];
    u32 sid = (((u32)h[5] << 24) | ((u32)h[6] << 16) | ((u32)h[7] << 8) | h[8]) & 0x7fffffff;
    return h2_frame(s, c, hc, d, e, dir, len, h[3], h[4], sid);
}

/* The frame's payload is used up, and h2_step has yet to take its end. */
static __always_inline int h2_frame_ending(struct h2dir *d)
{
    return d->fstate != F_HDR && d->left == 0;
}

/* One byte of a :path value at i. Its own branch of h2_step, with every bound re-read from
 * memory: the verifier processes ~150k fewer instructions than with it in h2_str_byte. */
static __always_inline void h2_path_step(struct scratch *s, struct h2dir *d,
                                         struct http_record *rec, u32 i)
{
    u32 at = i - s->base;
    if (VLD(d->slen) == 0 || VLD(d->left) == 0 || at >= VLD(s->n))
        return;
    d->spos += 1;
    d->slen -= 1;
    d->left -= 1;
    s->off = i + 1;
    h2_path_byte(d, rec, s->buf[at & (SCRATCH_SIZE - 1)]);
}

/* One step: a frame header, a run of bytes skipped by count, a string copied, or one byte, and
 * then the integer or string it completes; or a transition that needs no byte (a payload or
 * frame ended, an empty string). Each heavy part has one call site here, so the verifier sees
 * it once per step. */
static __always_inline int h2_step(struct scratch *s, struct conn *c, struct h2conn *hc,
                                   struct h2dir *d, struct h2end *e, int dir,
                                   struct http_record *rec)
{
    u32 i = VLD(s->off);
    u8 fs = VLD(d->fstate);
    u8 hs = VLD(d->hs);
    if (fs == F_BLOCK && hs == HS_STR && d->slen == 0)
        return h2_str_done(hc, d, dir, rec);
    if (fs != F_HDR && d->left == 0)
        return fs == F_SKIP ? h2_frame_done(d, e, dir, rec) : h2_payload_end(d, e, dir, rec);
    if (i >= s->total)
        return STEP_STOP;
    if (fs == F_SKIP || (fs == F_BLOCK && hs == HS_STR && d->kind == K_OTHER)) {
        /* payload or a string we do not need: skipped by count, never looked at */
        u32 n = s->total - i;
        if (n > d->left)
            n = d->left;
        if (fs == F_BLOCK && n > d->slen)
            n = d->slen;
        s->off = i + n;
        d->left -= n;
        if (fs == F_BLOCK) {
            d->slen -= n;
            d->spos += n;
        }
        return STEP_GO;
    }
    if (!visible(s, i))
        return STEP_RELOAD;
    if (fs == F_HDR)
        return h2_frame_header(s, c, hc, d, e, dir, i);
    if (fs == F_BLOCK && hs == HS_STR && d->phase == PH_VALLEN) {
        u32 n = d->slen;
        u32 at = i - s->base;
        if (d->kind == K_PATH) {
            h2_path_step(s, d, rec, i);
            return STEP_GO;
        }
        if (d->kind == K_TP && !d->spos && n <= TP_CAP && n <= d->left && at + n <= s->n) {
            /* a traceparent value wholly in the window and the frame: one copy, not a byte a
             * step */
            bpf_probe_read_kernel(rec->tp, n & 63, &s->buf[at & (SCRATCH_SIZE - 1)]);
            s->off = i + n;
            d->left -= n;
            d->slen = 0;
            d->spos = n;
            return STEP_GO;
        }
    }
    if (fs == F_BLOCK && hs == HS_STR && d->phase == PH_NAMELEN && !d->spos) {
        /* a short literal name wholly in the window and the frame: two words, one step */
        u32 n = d->slen;
        u32 at = i - s->base;
        if (n <= 16 && n <= d->left && at + 16 <= s->n) {
            u64 w0 = *(u64 *)&s->buf[at & (SCRATCH_SIZE - 1)];
            u64 w1 = *(u64 *)&s->buf[(at + 8) & (SCRATCH_SIZE - 1)];
            d->name0 = n >= 8 ? w0 : w0 & ((1ULL << (8 * n)) - 1);
            d->name1 = n >= 16 ? w1 : n <= 8 ? 0 : w1 & ((1ULL << (8 * (n - 8))) - 1);
            s->off = i + n;
            d->left -= n;
            d->slen = 0;
            d->spos = n;
            return STEP_GO;
        }
    }
    u8 b = BYTE(i);
    s->off = i + 1;
    d->left -= 1;
    if (fs == F_PRE)
        return h2_pre_byte(d, e, dir, b);
    if (h2_hpack_byte(d, rec, b)) {
        /* the byte completed an integer: taken in the same step (one step per indexed field) */
        if (d->numbad & 8)
            return H2_BAD_HPACK;
        return h2_int_done(hc, d, dir, rec);
    }
    return STEP_GO;
}

/* A scan is done. In the syscall's exit pass, the notes syscall_exit() would have run come
 * next. */
static __always_inline void h2_done(void *ctx, struct scratch *s)
{
    if (s->h2_more == H2_MORE_EXIT && s->nnotes)
        progs.call(ctx, PROG_RUN_NOTES);
}

/* Framing lost: nothing more is scanned on this connection, and its open streams end now. */
static __always_inline int h2_die(void *ctx, struct h2conn *hc, struct h2end *e)
{
    hc->dead = 1;
    h2_flush(ctx, e, H2F_LOST);
    return 0;
}

/* The rest of the client preface, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n". */
static __always_inline int h2_preface(struct scratch *s, struct h2conn *hc)
{
#pragma clang loop unroll(disable)
    for (int k = 0; k < H2_PREFACE_LEN; k++) {
        u32 i = VLD(s->off);
        u8 got = VLD(hc->preface);
        if (got >= H2_PREFACE_LEN)
            return STEP_GO;
        if (i >= s->total)
            return STEP_STOP;
        if (!visible(s, i))
            return STEP_RELOAD;
        if (BYTE(i) != preface_byte(got))
            return STEP_BAD;
        hc->preface = got + 1;
        s->off = i + 1;
        if (got + 1 == H2_PREFACE_LEN)
            count(CNT_H2_CONNECTIONS);
    }
    return hc->preface >= H2_PREFACE_LEN ? STEP_GO : STEP_STOP;
}

/* What h2_scan hands its bpf_loop callback (h2_steps_rd, h2_steps_wr), on its stack; the
 * callback replaces rec when a header block starts. */
struct h2_loop {
    struct scratch *s;
    struct conn *c;
    struct h2conn *hc;
    struct h2dir *d;
    struct h2end *e;
    struct http_record *rec;
};

/* H2_LOOP_STEPS decoder steps; 1 stops the loop (scratch.step says why). */
static __always_inline int h2_steps(struct h2_loop *l, int dir)
{
    int r = STEP_GO;
#pragma unroll 1
    for (int k = 0; k < H2_LOOP_STEPS; k++) {
        /* nothing a step stored is carried in a register into the next: the verifier then
         * sees one state at this loop head and prunes */
        asm volatile("" ::: "memory");
        r = h2_step(l->s, l->c, l->hc, l->d, l->e, dir, l->rec);
        if (r == H2_REC) {
            struct h2dir *d = l->d;
            if (dir == DIR_RD && d->opening) {
                d->opening = 0;
                h2_open(l->s, l->c, l->hc, d, d->bsid);
            }
            struct http_record *rec = h2_block_rec(l->s, d);
            r = STEP_GO;
            if (!rec) {
                r = STEP_RELOAD;        /* no record to write to: go on in the next program */
                break;
            }
            l->rec = rec;
        } else if (r != STEP_GO) {
            break;
        }
    }
    l->s->step = r;
    return r != STEP_GO;
}

int h2_steps_rd(struct loop_arg a) { return h2_steps(a.ctx, DIR_RD); }
int h2_steps_wr(struct loop_arg a) { return h2_steps(a.ctx, DIR_WR); }

static __always_inline int h2_scan(void *ctx, int dir)
{
    int z = 0;
    struct scratch *s = scratch_map.lookup(&z);
    struct h2end *e = h2_ends.lookup(&z);
    if (!s || !e)
        return 0;
    u64 sk = s->sk;
    struct conn *c = conns.lookup(&sk);
    if (!c)
        return 0;
    if (c->flags & CONN_H2_NEW) {
        /* a response 101 (scan_resp): the server's frames start right after it. They must
         * open with SETTINGS, and the client's next bytes must be the preface; otherwise this
         * is another upgrade (WebSocket, ...) and the connection is ignored, as before. */
        c->flags &= ~(CONN_H2 | CONN_H2_NEW);
        h2_start(c, sk, 0, 1);
        if (!(c->flags & CONN_H2)) {
            c->flags |= CONN_IGNORED;
            return 0;
        }
    }
    struct h2conn *hc = h2conns.lookup(&sk);
    if (!hc) {
        count(CNT_H2_STATE_LOST);
        c->flags |= CONN_IGNORED;
        return 0;
    }
    if (hc->dead)
        return 0;
    if (hc->at_exit) {
        /* a scan left for its syscall's exit: it runs now, or it never ran (the thread
         * moved to another CPU) and the bytes it had left are lost to the framing */
        if (s->h2_more != H2_MORE_EXIT) {
            count(CNT_H2_UNSCANNED);
            return h2_die(ctx, hc, e);
        }
        hc->at_exit = 0;
    }
    if (e->sk != sk || e->now != s->now) {
        e->sk = sk;
        e->now = s->now;
        e->n = 0;
        e->flush = 0;
        e->resume = 0;
    }
    struct h2dir *d = &hc->d[dir & 1];
    if (!visible(s, s->off) && s->off < s->total && d->fstate != F_SKIP)
        s->walk_more = load_window(s);
    int r = STEP_GO;
    if (dir == DIR_RD && hc->preface < H2_PREFACE_LEN) {
        r = h2_preface(s, hc);
        if (r == STEP_BAD) {
            /* after an upgrade: some other protocol; "PRI *" alone: not HTTP/2 after all */
            if (!hc->upgraded)
                count(CNT_H2_PREFACE_BAD);
            c->flags |= CONN_IGNORED;
            h2conns.delete(&sk);
            return 0;
        }
        if (r != STEP_GO)
            goto out;
    }
    /* one record pointer for the whole loop: the open block's, else the ghost */
    struct http_record *rec = (d->fstate == F_PRE || d->fstate == F_BLOCK || d->block) ?
                              h2_block_rec(s, d) : ghost_record(sk);
    if (!rec)
        goto out;
    struct h2_loop l = {.s = s, .c = c, .hc = hc, .d = d, .e = e, .rec = rec};
    s->step = STEP_GO;
    if (dir == DIR_RD)
        bpf_loop(H2_STEPS / H2_LOOP_STEPS, LOOP_CB(h2_steps_rd), &l, 0);
    else
        bpf_loop(H2_STEPS / H2_LOOP_STEPS, LOOP_CB(h2_steps_wr), &l, 0);
    r = VLD(s->step);
    if (r == H2_NOT_H2) {
        c->flags |= CONN_IGNORED;
        h2conns.delete(&sk);
        return 0;
    }
    if (r == STEP_BAD || r == H2_BAD_HPACK) {
        count(r == STEP_BAD ? CNT_H2_FRAME_INVALID : CNT_H2_HPACK_INVALID);
        return h2_die(ctx, hc, e);
    }
out:;
    /* more to scan: bytes, or (the steps ran out on the last byte) the end of a frame, whose
     * transition needs no byte but may end a stream (h2_frame_done) */
    int more = r != STEP_STOP && (s->off < s->total || (r == STEP_GO && h2_frame_ending(d)));
    int blind = r == STEP_RELOAD && s->base == s->off && s->n == 0 && !s->walk_more;
    u32 self = dir == DIR_RD ? PROG_H2_RD : PROG_H2_WR;
    if (more && !blind && s->chain >= CHAIN_MAX - 1 && !s->h2_more) {
        /* out of tail calls (many streams in one read): the syscall's exit goes on, with
         * a budget of its own (syscall_exit()); the ends queued so far wait in h2_ends */
        s->h2_more = 1 + self;
        s->h2_tid = (u32)bpf_get_current_pid_tgid();
        hc->at_exit = 1;
        return 0;
    }
    if (more && (blind || s->chain >= CHAIN_MAX - 1)) {
        count(CNT_H2_UNSCANNED);        /* bytes we cannot see, or out of tail calls */
        return h2_die(ctx, hc, e);
    }
    if (e->n || e->flush) {
        e->resume = more ? 1 + self : 0;
        s->chain++;
        progs.call(ctx, PROG_H2_END);
        return 0;
    }
    if (more) {
        s->chain++;
        progs.call(ctx, self);
        return 0;
    }
    h2_done(ctx, s);
    return 0;
}

int h2_scan_rd(void *ctx) { return h2_scan(ctx, DIR_RD); }
int h2_scan_wr(void *ctx) { return h2_scan(ctx, DIR_WR); }

/* Stream `sid` ended (why: H2F_*). `snap`: its response ended in this write (END_STREAM or a
 * RST_STREAM): the work set is summed now and ends at the syscall's exit; otherwise (close,
 * GOAWAY, lost framing) it is dropped as at an HTTP/1.x close. */
static __always_inline void h2_finish(struct scratch *s, u64 sk, struct conn *c,
                                      struct h2conn *hc, u32 sid, u16 why, u64 now, int snap)
{
    u32 slot = (sid >> 1) & (H2_STREAMS - 1);
    if (hc->open[slot] != sid)
        return;                         /* ended already (a RST_STREAM after END_STREAM) */
    hc->open[slot] = 0;
    hc->nopen--;
    struct req_key key = {.sk = sk, .seq = sid};
    struct http_record *rec = reqs.lookup(&key);
    if (!rec) {
        count(CNT_H2_STATE_LOST);
        return;
    }
    if (!(rec->flags & REQF_HDR_DONE)) {
        /* its header block never completed: whether it carried a traceparent is unknown, and
         * a span without one would be a guess (a new trace) */
        count(CNT_H2_HEADERS_CUT);
        reqs.delete(&key);
        return;
    }
    if (!hc->d[DIR_WR].settings_seen) {
        /* no server answered in HTTP/2 (an HTTP/1.x-only server sent an error and closed,
         * or nothing): the bytes were a client's claim, not a request anyone served */
        count(CNT_H2_UNANSWERED);
        reqs.delete(&key);
        return;
    }
    /* a field referred to a dynamic-table entry whose value the kernel does not hold: if the
     * stream lacks a traceparent, that may have been it (shifts and masks, not branches: the
     * verifier walks this once per stream h2_end emits) */
    u32 unresolved = (rec->h2_flags / H2F_UNRESOLVED) & 1;
    u32 no_tp = ((u32)rec->tp_len - 1) >> 31;
    if (!rec->method_len || !rec->path_len || (unresolved & no_tp)) {
        /* RFC 9113 8.3.1: a request without :method or :path is malformed (the server
         * resets it); it is not a hop to put in the caller's trace. With a field unresolved,
         * the missing one may have been that field: counted apart, and a span would guess
         * its trace or its name. */
        count(CNT_H2_MALFORMED + unresolved);
        reqs.delete(&key);
        return;
    }
    rec->h2_flags |= why;
    if (snap) {
#ifdef WITH_WORKSET
        if (rec->ws_flags & WSF_STATS)
            ws_snapshot(rec, now);
#endif
        finish_request_ws(rec, c, now, 1);
#ifdef WITH_WORKSET
        note(s, WS_NOTE_CLOSE, (u32)bpf_get_current_pid_tgid(), rec->seq, rec->conn_id, now);
#endif
    } else if (rec->resp_start_ns) {
        rec->flags |= REQF_RESP_UNTERM;
        finish_request(rec, c, c->last_write_ns > rec->resp_start_ns ? c->last_write_ns : now);
    } else {
        rec->flags |= REQF_NO_RESPONSE;
        finish_request(rec, c, now);
    }
    send_record(rec);
    reqs.delete(&key);
}

/* What h2_end hands its bpf_loop callbacks, on its stack */
struct h2_end_loop {
    struct scratch *s;
    struct conn *c;
    struct h2conn *hc;
    struct h2end *e;
    u64 sk;
    u64 now;
    u32 above;                          /* flush: streams above this id */
    u32 from;                           /* flush: the first slot of this run */
    u16 why;
};

/* bpf_loop callback of h2_end: emit queued stream i. 1 when the queue is done. */
int h2_end_queued(struct loop_arg a)
{
    struct h2_end_loop *l = a.ctx;
    u32 k = a.index;
    struct h2end *e = l->e;
    if (k >= VLD(e->n))
        return 1;
    h2_finish(l->s, l->sk, l->c, l->hc, e->sid[k & (H2_ENDS - 1)], e->why[k & (H2_ENDS - 1)],
              l->now, 1);
    return 0;
}

/* bpf_loop callback of h2_end: end the stream in slot from + i if it is above the flush id. */
int h2_end_flush(struct loop_arg a)
{
    struct h2_end_loop *l = a.ctx;
    u32 slot = (l->from + (u32)a.index) & (H2_STREAMS - 1);
    u32 sid = VLD(l->hc->open[slot]);
    if (sid && sid > l->above)
        h2_finish(l->s, l->sk, l->c, l->hc, sid, l->why, l->now, 0);
    return 0;
}

/* Tail call PROG_H2_END: emit the streams the scanners queued, end every open stream above
 * e->flush_above when asked, then resume the scan that called it. */
int h2_end(void *ctx)
{
    int z = 0;
    struct h2end *e = h2_ends.lookup(&z);
    struct scratch *s = scratch_map.lookup(&z);
    if (!e || !s)
        return 0;
    u64 sk = e->sk;
    struct conn *c = conns.lookup(&sk);
    struct h2conn *hc = h2conns.lookup(&sk);
    if (!c || !hc) {
        e->n = 0;
        e->flush = 0;
        return 0;
    }
    struct h2_end_loop l = {.s = s, .c = c, .hc = hc, .e = e, .sk = sk,
                            .now = bpf_ktime_get_ns()};
    bpf_loop(H2_ENDS, LOOP_CB(h2_end_queued), &l, 0);
    e->n = 0;
    u16 why = e->flush;
    if (why) {
        l.above = e->flush_above;
        l.from = e->cursor;
        l.why = why;
        bpf_loop(H2_FLUSH_SLOTS, LOOP_CB(h2_end_flush), &l, 0);
        e->cursor = l.from + H2_FLUSH_SLOTS;
        if (e->cursor < H2_STREAMS) {
            s->chain++;
            progs.call(ctx, PROG_H2_END);   /* the next slots */
            return 0;
        }
        e->flush = 0;
    }
    u8 resume = e->resume;
    e->resume = 0;
    if (resume && s->sk == sk) {
        if (s->chain < CHAIN_MAX) {
            s->chain++;
            progs.call(ctx, resume - 1);    /* returns only when the call failed */
        }
        if (!s->h2_more) {              /* the syscall's exit goes on (see h2_scan) */
            s->h2_more = resume;
            s->h2_tid = (u32)bpf_get_current_pid_tgid();
            hc->at_exit = 1;
            return 0;
        }
        count(CNT_H2_UNSCANNED);        /* its bytes cannot be framed: nothing more is */
        hc->dead = 1;
    }
    h2_done(ctx, s);
    return 0;
}
