"""Drop a share of the TCP segments a server sends to this namespace, to cause real
retransmissions where tc netem is unavailable.

Usage (inside the client's network namespace): xdp_drop.py IFNAME SRC_PORT PERCENT
Attaches a generic-mode XDP program to IFNAME that drops PERCENT % of TCP segments with a
payload from SRC_PORT; prints "ready"; detaches on SIGTERM/SIGINT or when stdin closes.
"""

from __future__ import annotations

import signal
import sys

from bcc import BPF

SRC = r"""
#include <uapi/linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/ip.h>
#include <linux/tcp.h>

int drop(struct xdp_md *ctx) {
    void *data = (void *)(long)ctx->data, *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > end || eth->h_proto != htons(ETH_P_IP))
        return XDP_PASS;
    struct iphdr *ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > end || ip->protocol != IPPROTO_TCP || ip->ihl != 5)
        return XDP_PASS;
    struct tcphdr *tcp = (void *)(ip + 1);
    if ((void *)(tcp + 1) > end || tcp->source != htons(SRC_PORT))
        return XDP_PASS;
    u32 payload = ntohs(ip->tot_len) - ip->ihl * 4 - tcp->doff * 4;
    if (payload > 0 && bpf_get_prandom_u32() % 100 < PERCENT)
        return XDP_DROP;
    return XDP_PASS;
}
"""


def main() -> None:
    ifname, port, percent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    b = BPF(text=SRC, cflags=[f"-DSRC_PORT={port}", f"-DPERCENT={percent}"])
    fn = b.load_func("drop", BPF.XDP)
    b.attach_xdp(ifname, fn, BPF.XDP_FLAGS_SKB_MODE)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    try:
        sys.stdin.read()
    except KeyboardInterrupt:
        pass
    finally:
        b.remove_xdp(ifname, BPF.XDP_FLAGS_SKB_MODE)


if __name__ == "__main__":
    main()
