// An h2c (cleartext HTTP/2) server and client for tests/test_http2.py, with golang.org/x/net's
// HTTP/2 stack: Go's HPACK encoder Huffman-codes values, and indexes every field it may.
//
//	goh2c server PORT            serve /echo over h2c (prior knowledge); print "ready"
//	goh2c client PORT N          N concurrent requests on one connection, each with its own
//	                             traceparent; print "TRACEPARENT STATUS" per request
//	goh2c load PORT SECONDS C    C concurrent request loops on one connection for SECONDS
//	                             (bench/h2c.py); print "REQUESTS ERRORS P50_US P99_US"
package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sort"
	"strconv"
	"sync"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/h2c"
)

func serve(port string) {
	mux := http.NewServeMux()
	mux.HandleFunc("/echo/", func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("content-type", "text/plain")
		w.Write([]byte("ok"))
	})
	ln, err := net.Listen("tcp", "127.0.0.1:"+port)
	if err != nil {
		panic(err)
	}
	fmt.Println("ready")
	srv := &http.Server{Handler: h2c.NewHandler(mux, &http2.Server{MaxConcurrentStreams: 1000})}
	srv.Serve(ln)
}

func traceparent() string {
	b := make([]byte, 24)
	rand.Read(b)
	b[15] |= 1
	b[23] |= 1
	return "00-" + hex.EncodeToString(b[:16]) + "-" + hex.EncodeToString(b[16:]) + "-01"
}

func client(port string, n int) {
	tr := &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
	}
	c := &http.Client{Transport: tr}
	var wg sync.WaitGroup
	var mu sync.Mutex
	out := make([]string, 0, n)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			tp := traceparent()
			req, _ := http.NewRequest("GET", "http://127.0.0.1:"+port+"/echo/"+strconv.Itoa(i)+"?secret=tj-h2-SECRET-query", nil)
			req.Header.Set("traceparent", tp)
			req.Header.Set("authorization", "Bearer tj-h2-SECRET-authorization")
			resp, err := c.Do(req)
			status := 0
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				status = resp.StatusCode
			}
			mu.Lock()
			out = append(out, fmt.Sprintf("%s %d", tp, status))
			mu.Unlock()
		}(i)
	}
	wg.Wait()
	for _, l := range out {
		fmt.Println(l)
	}
}

func load(port string, seconds float64, conc int) {
	tr := &http2.Transport{
		AllowHTTP: true,
		DialTLSContext: func(ctx context.Context, network, addr string, _ *tls.Config) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
	}
	c := &http.Client{Transport: tr}
	end := time.Now().Add(time.Duration(seconds * float64(time.Second)))
	var wg sync.WaitGroup
	var mu sync.Mutex
	var lat []time.Duration
	errors := 0
	for g := 0; g < conc; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []time.Duration
			bad := 0
			for time.Now().Before(end) {
				req, _ := http.NewRequest("GET", "http://127.0.0.1:"+port+"/echo/x", nil)
				req.Header.Set("traceparent", traceparent())
				t0 := time.Now()
				resp, err := c.Do(req)
				if err != nil {
					bad++
					continue
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				mine = append(mine, time.Since(t0))
			}
			mu.Lock()
			lat = append(lat, mine...)
			errors += bad
			mu.Unlock()
		}()
	}
	wg.Wait()
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) int64 {
		if len(lat) == 0 {
			return 0
		}
		return lat[int(p*float64(len(lat)-1))].Microseconds()
	}
	fmt.Printf("%d %d %d %d\n", len(lat), errors, pct(0.5), pct(0.99))
}

func main() {
	switch os.Args[1] {
	case "server":
		serve(os.Args[2])
	case "client":
		n, _ := strconv.Atoi(os.Args[3])
		client(os.Args[2], n)
	case "load":
		s, _ := strconv.ParseFloat(os.Args[3], 64)
		n, _ := strconv.Atoi(os.Args[4])
		load(os.Args[2], s, n)
	}
}
