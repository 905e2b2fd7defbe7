/*
 * The plain version-00 traceparent, read from the kernel's struct: shared by _trace_context.c
 * (correlate.trace_context's common case) and _span_bytes.c's batch writer, so both accept
 * exactly the same values. It can only accept: anything else is traceparent.parse's to decide.
 */
#ifndef TRACEJOIN_PLAIN_TRACEPARENT_H
#define TRACEJOIN_PLAIN_TRACEPARENT_H

#include <stdint.h>

#include "http_record.h"

#define PLAIN_TP_LEN 55 /* "00-" + 32 + "-" + 16 + "-" + 2 */

/* n lowercase hex digits -> *out; 0 when one is not lowercase hex. */
static inline int hex_u64(const char *s, int n, uint64_t *out)
{
    uint64_t v = 0;
    for (int i = 0; i < n; i++) {
        char c = s[i];
        unsigned d;
        if (c >= '0' && c <= '9')
            d = (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f')
            d = (unsigned)(c - 'a' + 10);
        else
            return 0;
        v = (v << 4) | d;
    }
    *out = v;
    return 1;
}

/* 1 and the ids when r carries exactly one traceparent header whose value is the plain valid
 * version-00 form (lowercase hex, the three dashes in place, 55 bytes, non-zero ids); else 0. */
static inline int plain_traceparent_ids(const struct http_record *r, uint64_t *hi, uint64_t *lo,
                                        uint64_t *parent, uint64_t *flags)
{
    const char *v = r->tp;
    return r->tp_count == 1 && !(r->h2_flags & H2F_TP_HUFF) && r->tp_len == PLAIN_TP_LEN
           && v[0] == '0' && v[1] == '0' && v[2] == '-' && v[35] == '-' && v[52] == '-'
           && hex_u64(v + 3, 16, hi) && hex_u64(v + 19, 16, lo) && hex_u64(v + 36, 16, parent)
           && hex_u64(v + 53, 2, flags) && (*hi | *lo) != 0 && *parent != 0;
}

#endif
