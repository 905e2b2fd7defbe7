"""A scripted TCP server for hand-built HTTP/2 frame sequences: the test says, on stdin, when it
reads how many bytes and what it writes, so the kernel sees exactly the reads and writes a case
needs (a HEADERS frame split across reads, a GOAWAY, ...).

    h2raw.py PORT        then lines: "read N" | "write HEX" | "close"; each answered "ok"
"""

from __future__ import annotations

import socket
import sys


def main() -> None:
    lsn = socket.socket()
    lsn.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsn.bind(("127.0.0.1", int(sys.argv[1])))
    lsn.listen(1)
    print("ready", flush=True)
    conn, _ = lsn.accept()
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "read":
            want, got = int(arg), 0
            while got < want:  # one recv per call: the test sent exactly this much
                chunk = conn.recv(want - got)
                if not chunk:
                    break
                got += len(chunk)
        elif cmd == "write":
            conn.sendall(bytes.fromhex(arg))
        elif cmd == "close":
            conn.close()
        print("ok", flush=True)


if __name__ == "__main__":
    main()
