/* A one-connection-at-a-time HTTP/1.1 server making CUDA runtime calls, linked with the runtime
 * stub statically (as nvcc links cudart by default) or dynamically (bench/cuda_cost.py), and the
 * driver stub dynamically. Per request to /work?n=N it allocates N bytes, copies them to the
 * "device" and back, synchronises and frees: the calls a span must show. /loop?n=K makes K
 * 64-byte cudaMemcpy calls and answers the thread CPU ns per call (a tight loop inside a request: its
 * thread is in the request's work set). Usage: server PORT (prints "ready" once it listens), or
 * server loop K (the same loop outside any request, printed). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

typedef int cudaError_t;
typedef struct CUstream_st *cudaStream_t;
cudaError_t cudaMalloc(void **devPtr, size_t size);
cudaError_t cudaFree(void *devPtr);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, int kind);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);

static void work(size_t n)
{
    char *host = calloc(1, n ? n : 1);
    void *dev = NULL;
    cudaMalloc(&dev, n);
    cudaMemcpy(dev, host, n, 1);
    cudaStreamSynchronize(NULL);
    cudaMemcpy(host, dev, n, 2);
    cudaFree(dev);
    free(host);
}

static double loop_ns(unsigned long k)
{
    static char host[64], dev[64];
    struct timespec a, b;
    /* CPU time: the probes run in this thread; a busy host's preemption does not count */
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &a);
    for (unsigned long i = 0; i < k; i++)
        cudaMemcpy(dev, host, sizeof(host), 1);
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &b);
    return ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / (k ? k : 1);
}

int main(int argc, char **argv)
{
    if (argc > 2 && !strcmp(argv[1], "loop")) {
        printf("%.1f\n", loop_ns(strtoul(argv[2], NULL, 10)));
        return 0;
    }
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(atoi(argv[1]))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (argc < 2 || bind(ls, (struct sockaddr *)&a, sizeof(a)) || listen(ls, 16))
        return 1;
    printf("ready\n");
    fflush(stdout);
    for (;;) {
        int c = accept(ls, NULL, NULL);
        char buf[4096];
        size_t got = 0;
        while (got < sizeof(buf) - 1) {
            ssize_t r = read(c, buf + got, sizeof(buf) - 1 - got);
            if (r <= 0)
                break;
            got += r;
            buf[got] = 0;
            if (strstr(buf, "\r\n\r\n"))
                break;
        }
        char *q = strstr(buf, "n="), body[64] = "ok", resp[256];
        unsigned long n = q ? strtoul(q + 2, NULL, 10) : 0;
        if (!strncmp(buf, "GET /loop", 9))
            snprintf(body, sizeof(body), "%.1f\n", loop_ns(n));
        else
            work(n);
        int len = snprintf(resp, sizeof(resp),
                           "HTTP/1.1 200 OK\r\nContent-Length: %zu\r\nConnection: close\r\n\r\n%s",
                           strlen(body), body);
        if (write(c, resp, len) < 0)
            perror("write");
        close(c);
    }
}
