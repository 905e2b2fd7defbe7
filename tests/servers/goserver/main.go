// A net/http server the tests control: /sleep?ms=N; /chunks?n=N (a chunked response: N writes,
// each flushed with http.Flusher, so each chunk is its own write; rows ending in ",0\r\n", so a
// chunk's last bytes look like the chunked terminator); anything else 200 "ok".
// Usage: goserver PORT. Prints "ready" once listening.
package main

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"
)

func main() {
	ln, err := net.Listen("tcp", "127.0.0.1:"+os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/chunks" {
			n, _ := strconv.Atoi(r.URL.Query().Get("n"))
			w.Header().Set("Content-Type", "text/plain")
			for i := 0; i < n; i++ {
				fmt.Fprintf(w, "row %d,0\r\n", i)
				w.(http.Flusher).Flush()
			}
			return
		}
		if r.URL.Path == "/sleep" {
			ms, _ := strconv.Atoi(r.URL.Query().Get("ms"))
			time.Sleep(time.Duration(ms) * time.Millisecond)
		}
		w.Header().Set("Content-Type", "text/plain")
		w.Write([]byte("ok\n"))
	})
	fmt.Println("ready")
	http.Serve(ln, nil)
}
