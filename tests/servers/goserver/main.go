// A net/http server the tests control: /sleep?ms=N; /chunks?n=N (a chunked response: N writes,
// each flushed with http.Flusher, so each chunk is its own write; rows ending in ",0\r\n", so a
// chunk's last bytes look like the chunked terminator); /chan?n=N&ms=M (the handler passes a
// job to a worker goroutine through a channel and waits for its reply; the worker touches N
// fresh pages, then spins on the CPU for M ms); anything else 200 "ok".
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

type job struct {
	pages int
	spin  time.Duration
	done  chan struct{}
}

// worker does each job it receives, then replies on the job's channel.
func worker(jobs <-chan job) {
	for j := range jobs {
		buf := make([]byte, j.pages*os.Getpagesize())
		for i := 0; i < len(buf); i += os.Getpagesize() {
			buf[i] = 1
		}
		for end := time.Now().Add(j.spin); time.Now().Before(end); {
		}
		j.done <- struct{}{}
	}
}

func main() {
	jobs := make(chan job)
	go worker(jobs)
	ln, err := net.Listen("tcp", "127.0.0.1:"+os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/chunks":
			n, _ := strconv.Atoi(r.URL.Query().Get("n"))
			w.Header().Set("Content-Type", "text/plain")
			for i := 0; i < n; i++ {
				fmt.Fprintf(w, "row %d,0\r\n", i)
				w.(http.Flusher).Flush()
			}
			return
		case "/sleep":
			ms, _ := strconv.Atoi(r.URL.Query().Get("ms"))
			time.Sleep(time.Duration(ms) * time.Millisecond)
		case "/chan":
			n, _ := strconv.Atoi(r.URL.Query().Get("n"))
			ms, _ := strconv.Atoi(r.URL.Query().Get("ms"))
			j := job{pages: n, spin: time.Duration(ms) * time.Millisecond, done: make(chan struct{})}
			jobs <- j
			<-j.done
		}
		w.Header().Set("Content-Type", "text/plain")
		w.Write([]byte("ok\n"))
	})
	fmt.Println("ready")
	http.Serve(ln, nil)
}
