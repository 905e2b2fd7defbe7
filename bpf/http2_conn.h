/* HTTP/2 (cleartext, h2c) connection state: what the HTTP/1.x path hands over when a connection
 * turns out to speak HTTP/2, and the maps the HTTP/2 programs (bpf/http2_scan.h) share.
 * Part of the bpf/http.c compile unit, included before http_conn.h (which calls h2_close()).
 *
 * A connection becomes HTTP/2 in one of two ways, and only from its first byte on, so every
 * frame and every HPACK dynamic-table insertion is seen:
 *   prior knowledge   its first read starts "PRI *" (open_request, http_request.h): the rest of
 *                     the client preface is checked by the read scanner;
 *   Upgrade: h2c      a response 101 (response_headers_end, http_response.h): the server's
 *                     frames start right after it and must open with SETTINGS, the client's
 *                     next bytes must be the preface; anything else is another upgrade
 *                     (WebSocket, ...) and the connection is ignored as before.
 * A connection that predates the agent is not followed: its frame boundaries and dynamic table
 * cannot be known (it counts as a non-HTTP/1.x connection).
 *
 * Each stream is one request: its record lives in `reqs` under {sk, stream id} (struct
 * http_record, H2F_STREAM in h2_flags), opened by the client's first HEADERS frame and emitted
 * when the server's END_STREAM, a RST_STREAM, a GOAWAY or the connection's end closes it.
 */

#define H2_STREAMS 256          /* streams tracked at once per connection (slot = id/2 mod this) */
#define H2_KINDS 128            /* newest dynamic-table insertions whose kind is remembered */
#define H2_ENDS 8               /* streams one end-program run emits */
#define H2_FLUSH_SLOTS 32       /* slots one end-program run flushes */
#define H2_PREFACE_LEN 24
#define H2_MORE_EXIT 0xff       /* scratch.h2_more: the exit pass is running */

/* What a header field is to us (struct h2dir.kind, h2dyn.kind). Only these are ever copied. */
enum { K_OTHER, K_TP, K_PATH, K_METHOD, K_STATUS, K_GRPC_STATUS };

/* Frame walk (h2dir.fstate) */
enum {
    F_HDR,      /* the 9-byte frame header (hgot bytes of it in hb[]) */
    F_PRE,      /* pad length, priority or promised stream id before a header block */
    F_BLOCK,    /* header block fragment bytes: the HPACK decoder's */
    F_SKIP,     /* payload bytes skipped by count (DATA, SETTINGS, ..., padding) */
};

/* HPACK decoder (h2dir.hs) and which integer or string it is reading (h2dir.phase) */
enum { HS_REP, HS_INT, HS_STRLEN, HS_STR };
enum { PH_IDX, PH_NAMEIDX, PH_SIZE, PH_NAMELEN, PH_VALLEN };

/* One direction's parser: frames, and the HPACK block state that spans frames (CONTINUATION)
 * and reads. d[0] parses what the server reads (requests), d[1] what it writes. */
struct h2dir {
    u32 left;                   /* bytes of the current frame's payload still to come, padding
                                 * excluded (F_PRE, F_BLOCK, F_SKIP) */
    u32 padleft;                /* padding after them */
    u32 sid;                    /* the current frame's stream */
    u32 bsid;                   /* the open header block's stream */
    u32 ival;                   /* HPACK integer being read */
    u32 slen;                   /* HPACK string bytes still to come */
    u32 spos;                   /* ... and already seen */
    u32 ins;                    /* insertions into this direction's dynamic table since the preface */
    u64 name0, name1;           /* the first 16 bytes of a literal header name */
    u32 num;                    /* a decimal value being decoded (:status, grpc-status) */
    u32 hbits;                  /* Huffman bits of it not yet decoded */
    u8 hnb;                     /* ... how many */
    u8 fstate;                  /* F_* */
    u8 ftype, fflags;
    u8 hgot;                    /* frame-header bytes gathered in hb[] */
    u8 pre;                     /* F_PRE bytes still to skip */
    u8 hs;                      /* HS_* */
    u8 phase;                   /* PH_* */
    u8 ishift;
    u8 inc;                     /* the field is inserted into the dynamic table at its end */
    u8 kind;                    /* K_* of the field being read */
    u8 huff;                    /* the string being read is Huffman-coded */
    u8 block;                   /* a header block is open: CONTINUATION must follow */
    u8 ghost;                   /* the open block's fields go to the ghost record */
    u8 numbad;                  /* the value is not a decimal number */
    u8 settings_seen;           /* write side: the server's first frame was SETTINGS */
    u8 ikind;                   /* K_* the field has as a table entry (kind may say "not copied") */
    u8 endafter;                /* the open block's HEADERS frame had END_STREAM */
    u8 hb[9];
    u8 qmin;                    /* Huffman :path: the smallest next byte that would complete a
                                 * run of eight 1-bits (bpf/http2_scan.h h2_str_byte) */
    u8 opening;                 /* read side: the block's HEADERS frame may open a stream (h2_open) */
    u8 _pad[3];
    u8 kinds[H2_KINDS];         /* K_* of insertion n, at n % H2_KINDS */
};

struct h2conn {
    u64 conn_id;
    u32 last_sid;               /* highest client stream opened */
    u32 nopen;
    u8 preface;                 /* client preface bytes matched (H2_PREFACE_LEN: done) */
    u8 upgraded;                /* became HTTP/2 by Upgrade: h2c (a failed check is quiet) */
    u8 dead;                    /* framing lost: nothing more is scanned */
    u8 at_exit;                 /* a scan was left for its syscall's exit (scratch.h2_more) */
    u8 _pad[4];
    u32 open[H2_STREAMS];       /* stream id open in each slot; 0 free */
    struct h2dir d[2];
};

/* A dynamic-table entry we need, by {connection, direction, insertion number}: the value as the
 * wire carried it (Huffman-coded or not), for a later field that refers to it by index. */
struct h2dyn_key {
    u64 conn_id;
    u32 ins;
    u32 dir;
};
struct h2dyn {
    u8 kind;                    /* K_* */
    u8 huff;
    u8 len;                     /* bytes in val[] */
    u8 trunc;                   /* the value was longer than what val[] holds */
    u16 full;                   /* its length on the wire (saturating) */
    u16 num;                    /* K_STATUS, K_GRPC_STATUS: the decoded number (0xffff: invalid) */
    u8 val[HTTP_PATH_MAX];
};

/* Streams the scanners ended, for the end program (PROG_H2_END), and its other jobs: end every
 * stream above a stream id (GOAWAY, the close, lost framing), then resume a scan. */
struct h2end {
    u64 sk;
    u64 now;                    /* scratch.now of the read/write that filled it */
    u32 n;
    u32 flush_above;            /* with `flush`: end every open stream with a higher id */
    u32 sid[H2_ENDS];
    u16 why[H2_ENDS];           /* H2F_* to add to the record */
    u16 flush;                  /* H2F_* for the flushed streams; 0: no flush */
    u8 resume;                  /* 1 + PROG_H2_* to tail-call afterwards; 0: none */
    u8 _pad[1];
    u32 cursor;                 /* the flush's next slot (H2_FLUSH_SLOTS slots per program) */
};

BPF_TABLE("lru_hash", u64, struct h2conn, h2conns, H2_CONNS);
BPF_TABLE("lru_hash", struct h2dyn_key, struct h2dyn, h2dyn, LRU_ENTRIES);
BPF_PERCPU_ARRAY(zero_h2, struct h2conn, 1);            /* never written: a zeroed template */
BPF_PERCPU_ARRAY(h2_ends, struct h2end, 1);

/* The connection turns HTTP/2: `preface` client-preface bytes are already matched. */
static __always_inline void h2_start(struct conn *c, u64 sk, u8 preface, u8 upgraded)
{
    int z = 0;
    struct h2conn *tmpl = zero_h2.lookup(&z);
    if (!tmpl || h2conns.update(&sk, tmpl) != 0)
        return;
    struct h2conn *hc = h2conns.lookup(&sk);
    if (!hc)
        return;
    hc->conn_id = c->conn_id;
    hc->preface = preface;
    hc->upgraded = upgraded;
    c->flags |= CONN_H2;
}

/* A tail call into PROG_H2_RD/WR returned: the HTTP/2 programs are not loaded (the agent
 * verifies them after it is ready, or they failed to load). The bytes this call held are then
 * unscanned, so the connection's framing is unknown for good: ignore it, never guess. */
static __always_inline void h2_not_loaded(struct conn *c)
{
    c->flags |= CONN_IGNORED;
    count(CNT_H2_NOT_LOADED);
}

/* End every open stream of e->sk (why: H2F_*) in PROG_H2_END; nothing is resumed after. */
static __always_inline void h2_flush(void *ctx, struct h2end *e, u16 why)
{
    e->flush = why;
    e->flush_above = 0;
    e->cursor = 0;
    e->resume = 0;
    progs.call(ctx, PROG_H2_END);
}

/* We are closing the connection (inet_sock_set_state): every stream still open ends now. */
static __always_inline void h2_close(void *ctx, u64 sk)
{
    int z = 0;
    struct h2end *e = h2_ends.lookup(&z);
    if (!e)
        return;
    e->sk = sk;
    e->n = 0;
    h2_flush(ctx, e, H2F_CLOSED);
}
