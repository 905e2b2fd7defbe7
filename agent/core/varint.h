/*
 * Protobuf base-128 varints, for the compiled writers of OTLP bytes (agent/pipeline/_span_bytes.c,
 * exporters/_request_bytes.c); otlp_wire.varint is the same in Python.
 */
#ifndef TRACEJOIN_VARINT_H
#define TRACEJOIN_VARINT_H

#include <Python.h>
#include <stdint.h>

static inline Py_ssize_t varint_len(uint64_t v)
{
    Py_ssize_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline char *put_varint(char *p, uint64_t v)
{
    while (v >= 0x80) {
        *p++ = (char)((v & 0x7f) | 0x80);
        v >>= 7;
    }
    *p++ = (char)v;
    return p;
}

#endif
