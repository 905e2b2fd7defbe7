/* Test double of the CUDA driver, libcuda.so.1: the real symbol names with the real signatures
 * (cuda.h). "Device" memory is host memory; copies are memcpy; cuStreamSynchronize sleeps
 * STUB_SYNC_US, the known time a span's sync wait must cover. Built by tests/cuda_stubs.py. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUstream_st *CUstream;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct CUfunc_st *CUfunction;

#ifndef STUB_SYNC_US
#define STUB_SYNC_US 30000
#endif

static void sleep_us(long us)
{
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0)
        ;
}

CUresult cuInit(unsigned int flags) { (void)flags; return 0; }

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize)
{
    void *p = malloc(bytesize ? bytesize : 1);
    if (!p)
        return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    *dptr = (CUdeviceptr)p;
    return 0;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) { free((void *)dptr); return 0; }

CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n)
{
    memcpy((void *)dst, src, n);
    return 0;
}

CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n)
{
    memcpy(dst, (const void *)src, n);
    return 0;
}

CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n)
{
    memcpy((void *)dst, (const void *)src, n);
    return 0;
}

CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, CUstream s)
{
    (void)s;
    memcpy((void *)dst, src, n);
    return 0;
}

CUresult cuStreamSynchronize(CUstream s)
{
    (void)s;
    sleep_us(STUB_SYNC_US);
    return 0;
}

CUresult cuCtxSynchronize(void) { sleep_us(STUB_SYNC_US); return 0; }

CUresult cuGraphLaunch(CUgraphExec g, CUstream s) { (void)g; (void)s; return 0; }

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, CUstream s, void **params,
                        void **extra)
{
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shared;
    (void)s; (void)params; (void)extra;
    return 0;
}
