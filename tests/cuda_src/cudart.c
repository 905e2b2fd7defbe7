/* Test double of the CUDA runtime, libcudart.so.12: the real symbol names with the real
 * signatures (cuda_runtime_api.h), each calling the driver stub beneath it as the real runtime
 * does, so a span that counted both layers would count twice. cudaMemcpy records its arguments
 * (stub_last_memcpy) and returns. Built by tests/cuda_stubs.py, as a shared library or into a
 * static executable. */
#include <stddef.h>

typedef int cudaError_t;
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef struct CUstream_st *cudaStream_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t n);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t n, cudaStream_t s);
CUresult cuStreamSynchronize(cudaStream_t s);
CUresult cuCtxSynchronize(void);
CUresult cuGraphLaunch(cudaGraphExec_t g, cudaStream_t s);

/* The last cudaMemcpy's arguments and the calls so far: the test reads them back. */
struct stub_memcpy {
    void *dst;
    const void *src;
    size_t count;
    int kind;
    unsigned long calls;
};
struct stub_memcpy stub_last_memcpy;

cudaError_t cudaMalloc(void **devPtr, size_t size)
{
    return cuMemAlloc_v2((CUdeviceptr *)devPtr, size);
}

cudaError_t cudaFree(void *devPtr) { return cuMemFree_v2((CUdeviceptr)devPtr); }

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
    stub_last_memcpy.dst = dst;
    stub_last_memcpy.src = src;
    stub_last_memcpy.count = count;
    stub_last_memcpy.kind = kind;
    stub_last_memcpy.calls++;
    switch (kind) {
    case cudaMemcpyHostToDevice:
        return cuMemcpyHtoD_v2((CUdeviceptr)dst, src, count);
    case cudaMemcpyDeviceToHost:
        return cuMemcpyDtoH_v2(dst, (CUdeviceptr)src, count);
    case cudaMemcpyDeviceToDevice:
        return cuMemcpyDtoD_v2((CUdeviceptr)dst, (CUdeviceptr)src, count);
    default:
        return 1; /* cudaErrorInvalidValue */
    }
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t stream)
{
    if (kind != cudaMemcpyHostToDevice)
        return cudaMemcpy(dst, src, count, kind);
    return cuMemcpyHtoDAsync_v2((CUdeviceptr)dst, src, count, stream);
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) { return cuStreamSynchronize(stream); }

cudaError_t cudaDeviceSynchronize(void) { return cuCtxSynchronize(); }

cudaError_t cudaGraphLaunch(cudaGraphExec_t g, cudaStream_t s) { return cuGraphLaunch(g, s); }
