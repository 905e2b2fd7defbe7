// tj-loadgen: the benchmark's own load generator and syscall loop. Standard library only.
//
//	tj-loadgen rate -addr 127.0.0.1:8080 -path / -rate 5000 -duration 5s -conns 32
//	tj-loadgen syscall -n 2000000
//	tj-loadgen switch -n 200000
//
// rate: an open-loop, constant-rate HTTP/1.1 client. Request i is due at start + i/rate,
// whether or not earlier ones have been answered (no coordinated omission): a due request goes
// out on the first idle keep-alive connection, and waits in a queue when none is idle. Latency
// is measured from the time the request was DUE, so a server that falls behind shows it as
// latency, not as a lower offered rate. `service_us` is measured from the actual send.
// Every request carries its own W3C traceparent (unique trace id and parent id, sampled), so
// every request is one tracejoin traces.
//
// It is a single-threaded epoll loop over non-blocking sockets (raw syscalls), because the Go
// runtime's timers have ~1 ms granularity here: epoll_pwait2 with a nanosecond timeout and a
// 1 ns timer slack dispatch each request within a few µs of its due time (`send_lag_us` says
// how close it got).
//
// syscall: ns per call of read(2) of 1 byte from /dev/zero and from a pipe, write(2) of 1
// byte to /dev/null, and getppid(2) (a syscall tracejoin does not probe: the control). Raw
// syscalls, no Go scheduler hooks: the cost is the kernel's plus any attached BPF programs'.
//
// switch: ns per round trip of one byte between this process and a copy of it over two
// pipes, each side blocking in read(2) until the other writes: two context switches, two
// writes and two reads per round trip, on whatever CPUs the caller allows (pin to one CPU to
// measure the switches). Neither process is traced: what tracejoin adds is the cost of its
// scheduler and syscall-exit programs to every thread on the host.
//
// Each prints one JSON object on stdout (switch-peer, the copy, prints nothing).
package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand"
	"net"
	"os"
	"os/exec"
	"runtime"
	"sort"
	"strconv"
	"syscall"
	"time"
	"unsafe"
)

const sysEpollPwait2 = 441 // x86_64 and arm64 share the generic number since 5.11

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: tj-loadgen rate|syscall|switch [flags]")
		os.Exit(2)
	}
	var out any
	var err error
	switch os.Args[1] {
	case "rate":
		out, err = rateMain(os.Args[2:])
	case "syscall":
		out, err = syscallMain(os.Args[2:])
	case "switch":
		out, err = switchMain(os.Args[2:])
	case "switch-peer":
		switchPeer()
		return
	default:
		err = fmt.Errorf("unknown mode %q", os.Args[1])
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "tj-loadgen:", err)
		os.Exit(1)
	}
	enc := json.NewEncoder(os.Stdout)
	if err := enc.Encode(out); err != nil {
		os.Exit(1)
	}
}

// ------------------------------------------------------------------------------ rate

type conn struct {
	fd     int
	busy   bool
	due    int64 // ns since t0: when the request in flight was due
	sent   int64 // ns since t0: when it was written
	record bool  // inside the measured window
	buf    []byte
	n      int
}

type summary struct {
	P50  float64 `json:"p50"`
	P90  float64 `json:"p90"`
	P99  float64 `json:"p99"`
	P999 float64 `json:"p999"`
	Max  float64 `json:"max"`
	Mean float64 `json:"mean"`
}

type rateResult struct {
	Mode        string  `json:"mode"`
	Rate        float64 `json:"rate"`
	DurationS   float64 `json:"duration_s"`
	WarmupS     float64 `json:"warmup_s"`
	Conns       int     `json:"conns"`
	Scheduled   int64   `json:"scheduled"`           // due inside the measured window
	Completed   int64   `json:"completed"`           // of those, answered
	InWindow    int64   `json:"completed_in_window"` // of those, answered before the window ended
	Incomplete  int64   `json:"incomplete"`          // of those, not answered by the end of the drain
	Errors      int64   `json:"errors"`              // connection errors (reconnected)
	Non2xx      int64   `json:"non_2xx"`             // answered with a status other than 2xx
	TotalSent   int64   `json:"total_sent"`          // every request written, warm-up included
	AchievedRPS float64 `json:"achieved_rps"`        // completed / duration
	LatencyUs   summary `json:"latency_us"`          // from due time (open loop)
	ServiceUs   summary `json:"service_us"`          // from send time
	SendLagUs   summary `json:"send_lag_us"`         // send time - due time
	MaxQueue    int     `json:"max_queue"`           // most due requests waiting for a connection
}

func rateMain(args []string) (*rateResult, error) {
	fs := flag.NewFlagSet("rate", flag.ContinueOnError)
	addr := fs.String("addr", "127.0.0.1:8080", "server address")
	path := fs.String("path", "/", "request target")
	rate := fs.Float64("rate", 1000, "requests per second")
	duration := fs.Duration("duration", 5*time.Second, "measured window")
	warmup := fs.Duration("warmup", 500*time.Millisecond, "load before the measured window")
	drain := fs.Duration("drain", 2*time.Second, "wait for answers after the window")
	nconns := fs.Int("conns", 32, "keep-alive connections")
	seed := fs.Int64("seed", time.Now().UnixNano(), "trace id seed")
	unsampled := fs.Bool("unsampled", false, "traceparent flags 00 (the caller did not sample)")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if *rate <= 0 || *nconns <= 0 {
		return nil, fmt.Errorf("rate and conns must be > 0")
	}
	runtime.LockOSThread()
	// A 1 ns timer slack: the epoll timeout fires when asked, not up to 50 µs later.
	_, _, _ = syscall.RawSyscall(syscall.SYS_PRCTL, 29 /* PR_SET_TIMERSLACK */, 1, 0)

	host, portStr, err := net.SplitHostPort(*addr)
	if err != nil {
		return nil, err
	}
	port, _ := strconv.Atoi(portStr)
	ip := net.ParseIP(host).To4()
	if ip == nil {
		return nil, fmt.Errorf("need an IPv4 address, got %q", host)
	}
	sa := &syscall.SockaddrInet4{Port: port}
	copy(sa.Addr[:], ip)

	epfd, err := syscall.EpollCreate1(syscall.EPOLL_CLOEXEC)
	if err != nil {
		return nil, err
	}
	conns := make([]*conn, *nconns)
	byFd := map[int]*conn{}
	dial := func() (*conn, error) {
		fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
		if err != nil {
			return nil, err
		}
		if err := syscall.Connect(fd, sa); err != nil {
			syscall.Close(fd)
			return nil, err
		}
		_ = syscall.SetsockoptInt(fd, syscall.IPPROTO_TCP, syscall.TCP_NODELAY, 1)
		if err := syscall.SetNonblock(fd, true); err != nil {
			syscall.Close(fd)
			return nil, err
		}
		ev := syscall.EpollEvent{Events: syscall.EPOLLIN | syscall.EPOLLRDHUP, Fd: int32(fd)}
		if err := syscall.EpollCtl(epfd, syscall.EPOLL_CTL_ADD, fd, &ev); err != nil {
			syscall.Close(fd)
			return nil, err
		}
		c := &conn{fd: fd, buf: make([]byte, 64<<10)}
		byFd[fd] = c
		return c, nil
	}
	idle := make([]*conn, 0, *nconns)
	for i := range conns {
		c, err := dial()
		if err != nil {
			return nil, fmt.Errorf("connect %s: %w", *addr, err)
		}
		conns[i] = c
		idle = append(idle, c)
	}

	// The request, with the traceparent's hex digits rewritten per request.
	head := "GET " + *path + " HTTP/1.1\r\nHost: " + *addr + "\r\nUser-Agent: tj-loadgen\r\n" +
		"traceparent: 00-"
	flags := "01"
	if *unsampled {
		flags = "00"
	}
	req := []byte(head + "00000000000000000000000000000000-0000000000000000-" + flags + "\r\n\r\n")
	traceOff, spanOff := len(head), len(head)+33
	rng := rand.New(rand.NewSource(*seed))
	traceHi := rng.Uint64() | 1
	const hexd = "0123456789abcdef"
	putHex := func(dst []byte, v uint64) {
		for i := 15; i >= 0; i-- {
			dst[i] = hexd[v&15]
			v >>= 4
		}
	}
	var seq uint64

	res := &rateResult{Mode: "rate", Rate: *rate, DurationS: duration.Seconds(),
		WarmupS: warmup.Seconds(), Conns: *nconns}
	capHint := int(*rate*duration.Seconds()) + 16
	lat := make([]int64, 0, capHint)
	svc := make([]int64, 0, capHint)
	lag := make([]int64, 0, capHint)

	t0 := time.Now()
	now := func() int64 { return int64(time.Since(t0)) }
	interval := 1e9 / *rate
	winStart := int64(warmup.Nanoseconds())
	winEnd := winStart + duration.Nanoseconds()
	drainEnd := winEnd + drain.Nanoseconds()
	var i int64 // next request index
	due := func(k int64) int64 { return int64(float64(k) * interval) }
	queue := make([]int64, 0, 1024) // due times waiting for a connection
	qh := 0

	send := func(c *conn, d int64) {
		seq++
		putHex(req[traceOff:], traceHi)
		// The trace id's low 8 bytes are what a TraceIdRatioBased sampler (and the agent's
		// overload budget, in the kernel) reads: spread like a random id's, as an SDK's are,
		// and still unique (multiplying by an odd constant is a bijection mod 2^64). A plain
		// counter there would sit below every ratio's bound, so nothing would ever be shed.
		putHex(req[traceOff+16:], seq*0x9E3779B97F4A7C15)
		putHex(req[spanOff:], (seq*0xC2B2AE3D27D4EB4F)|1)
		t := now()
		if _, err := syscall.Write(c.fd, req); err != nil {
			res.Errors++
		}
		c.busy, c.due, c.sent = true, d, t
		c.record = d >= winStart && d < winEnd
		res.TotalSent++
		if c.record {
			lag = append(lag, t-d)
		}
	}
	reconnect := func(c *conn) {
		_ = syscall.EpollCtl(epfd, syscall.EPOLL_CTL_DEL, c.fd, nil)
		syscall.Close(c.fd)
		delete(byFd, c.fd)
		nc, err := dial()
		if err != nil {
			return // this connection slot is gone; the others carry on
		}
		*c = *nc
		byFd[c.fd] = c
		idle = append(idle, c)
	}
	// One complete response at the front of c.buf? Returns its length, or 0.
	parse := func(c *conn) (int, bool) {
		b := c.buf[:c.n]
		he := bytes.Index(b, []byte("\r\n\r\n"))
		if he < 0 {
			return 0, false
		}
		hdr := b[:he]
		cl := 0
		for _, line := range bytes.Split(hdr, []byte("\r\n"))[1:] {
			if len(line) > 15 && bytes.EqualFold(line[:15], []byte("content-length:")) {
				cl, _ = strconv.Atoi(string(bytes.TrimSpace(line[15:])))
			}
		}
		total := he + 4 + cl
		if c.n < total {
			return 0, false
		}
		ok := len(hdr) >= 12 && hdr[9] == '2'
		return total, ok
	}

	events := make([]syscall.EpollEvent, 64)
	var ts syscall.Timespec
	usePwait2 := true
	for {
		t := now()
		for t >= due(i) && due(i) < winEnd {
			queue = append(queue, due(i))
			i++
		}
		for qh < len(queue) && len(idle) > 0 {
			c := idle[len(idle)-1]
			idle = idle[:len(idle)-1]
			send(c, queue[qh])
			qh++
		}
		if qh == len(queue) {
			queue, qh = queue[:0], 0
		}
		if w := len(queue) - qh; w > res.MaxQueue {
			res.MaxQueue = w
		}
		if t >= winEnd && (len(idle) == len(byFd) || t >= drainEnd) {
			break
		}
		var wait int64
		if due(i) < winEnd {
			wait = due(i) - now()
		} else {
			wait = drainEnd - now()
		}
		if wait < 0 {
			wait = 0
		}
		var n int
		if usePwait2 {
			ts.Sec, ts.Nsec = wait/1e9, wait%1e9
			r, _, e := syscall.Syscall6(sysEpollPwait2, uintptr(epfd),
				uintptr(unsafe.Pointer(&events[0])), uintptr(len(events)),
				uintptr(unsafe.Pointer(&ts)), 0, 0)
			switch e {
			case 0:
				n = int(r)
			case syscall.EINTR:
				n = 0
			case syscall.ENOSYS:
				usePwait2 = false
				continue
			default:
				return nil, e
			}
		} else {
			n, err = syscall.EpollWait(epfd, events, int((wait+999_999)/1_000_000))
			if err != nil && err != syscall.EINTR {
				return nil, err
			}
		}
		for k := 0; k < n; k++ {
			c := byFd[int(events[k].Fd)]
			if c == nil {
				continue
			}
			dead := false
			for {
				if c.n == len(c.buf) {
					dead = true // a response larger than 64 KiB: not this benchmark's server
					break
				}
				m, err := syscall.Read(c.fd, c.buf[c.n:])
				if err == syscall.EAGAIN {
					break
				}
				if err != nil || m == 0 {
					dead = true
					break
				}
				c.n += m
			}
			for c.busy {
				size, ok := parse(c)
				if size == 0 {
					break
				}
				t := now()
				if c.record {
					lat = append(lat, t-c.due)
					svc = append(svc, t-c.sent)
					res.Completed++
					if t < winEnd {
						res.InWindow++
					}
					if !ok {
						res.Non2xx++
					}
				}
				copy(c.buf, c.buf[size:c.n])
				c.n -= size
				c.busy = false
				idle = append(idle, c)
			}
			if dead {
				res.Errors++
				if c.busy {
					// drop it from the idle list if it got there; reconnect puts it back
					c.busy = false
				} else {
					for j, x := range idle {
						if x == c {
							idle = append(idle[:j], idle[j+1:]...)
							break
						}
					}
				}
				reconnect(c)
			}
		}
	}
	for k := int64(0); k < i; k++ {
		if d := due(k); d >= winStart && d < winEnd {
			res.Scheduled++
		}
	}
	res.Incomplete = res.Scheduled - res.Completed
	// Throughput is what the server answered inside the window: answers that came during the
	// drain are a queue emptying, and counting them would read 1.000 for a server that fell behind.
	res.AchievedRPS = float64(res.InWindow) / duration.Seconds()
	res.LatencyUs, res.ServiceUs, res.SendLagUs = summarize(lat), summarize(svc), summarize(lag)
	for _, c := range byFd {
		syscall.Close(c.fd)
	}
	return res, nil
}

func summarize(ns []int64) summary {
	if len(ns) == 0 {
		return summary{}
	}
	sort.Slice(ns, func(a, b int) bool { return ns[a] < ns[b] })
	q := func(p float64) float64 {
		k := int(p * float64(len(ns)-1))
		return float64(ns[k]) / 1e3
	}
	var sum float64
	for _, v := range ns {
		sum += float64(v)
	}
	return summary{P50: q(0.50), P90: q(0.90), P99: q(0.99), P999: q(0.999),
		Max: float64(ns[len(ns)-1]) / 1e3, Mean: sum / float64(len(ns)) / 1e3}
}

// ------------------------------------------------------------------------------ syscall

type syscallResult struct {
	Mode         string  `json:"mode"`
	Calls        int     `json:"calls"`
	Rounds       int     `json:"rounds"`
	ReadDevZero  float64 `json:"read_devzero_ns"`
	ReadPipe     float64 `json:"read_pipe_ns"`
	WriteDevNull float64 `json:"write_devnull_ns"`
	Getppid      float64 `json:"getppid_ns"`
}

func syscallMain(args []string) (*syscallResult, error) {
	fs := flag.NewFlagSet("syscall", flag.ContinueOnError)
	n := fs.Int("n", 2_000_000, "calls per measurement")
	rounds := fs.Int("rounds", 5, "measurements per syscall; the median is reported")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	runtime.LockOSThread()
	zero, err := syscall.Open("/dev/zero", syscall.O_RDONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	null, err := syscall.Open("/dev/null", syscall.O_WRONLY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	var p [2]int
	if err := syscall.Pipe2(p[:], syscall.O_CLOEXEC); err != nil {
		return nil, err
	}
	var one [1]byte
	chunk := make([]byte, 65536) // one pipe buffer: refilled once per 65536 reads
	b := uintptr(unsafe.Pointer(&one[0]))

	loop := func(fn func(int)) float64 {
		per := make([]float64, *rounds)
		for r := range per {
			t := time.Now()
			fn(*n)
			per[r] = float64(time.Since(t).Nanoseconds()) / float64(*n)
		}
		sort.Float64s(per)
		return per[len(per)/2]
	}
	res := &syscallResult{Mode: "syscall", Calls: *n, Rounds: *rounds}
	res.Getppid = loop(func(k int) {
		for j := 0; j < k; j++ {
			syscall.RawSyscall(syscall.SYS_GETPPID, 0, 0, 0)
		}
	})
	res.ReadDevZero = loop(func(k int) {
		for j := 0; j < k; j++ {
			syscall.RawSyscall(syscall.SYS_READ, uintptr(zero), b, 1)
		}
	})
	res.WriteDevNull = loop(func(k int) {
		for j := 0; j < k; j++ {
			syscall.RawSyscall(syscall.SYS_WRITE, uintptr(null), b, 1)
		}
	})
	res.ReadPipe = loop(func(k int) {
		left := 0
		for j := 0; j < k; j++ {
			if left == 0 {
				if _, err := syscall.Write(p[1], chunk); err != nil {
					return
				}
				left = len(chunk)
			}
			syscall.RawSyscall(syscall.SYS_READ, uintptr(p[0]), b, 1)
			left--
		}
		for left > 0 { // leave the pipe empty for the next round
			m, _ := syscall.Read(p[0], chunk[:left])
			if m <= 0 {
				break
			}
			left -= m
		}
	})
	return res, nil
}

// ------------------------------------------------------------------------------ switch

type switchResult struct {
	Mode      string  `json:"mode"`
	RoundTrip int     `json:"round_trips"`
	Rounds    int     `json:"rounds"`
	SwitchNs  float64 `json:"round_trip_ns"` // median over rounds
}

func switchMain(args []string) (*switchResult, error) {
	fs := flag.NewFlagSet("switch", flag.ContinueOnError)
	n := fs.Int("n", 200_000, "round trips per measurement")
	rounds := fs.Int("rounds", 5, "measurements; the median is reported")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	runtime.LockOSThread()
	var ping, pong [2]int // blocking pipes: [0] reads, [1] writes
	if err := syscall.Pipe2(ping[:], syscall.O_CLOEXEC); err != nil {
		return nil, err
	}
	if err := syscall.Pipe2(pong[:], syscall.O_CLOEXEC); err != nil {
		return nil, err
	}
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	peer := exec.Command(self, "switch-peer")
	// fd 3 in the peer: read pings; fd 4: write pongs
	peer.ExtraFiles = []*os.File{
		os.NewFile(uintptr(ping[0]), "ping"), os.NewFile(uintptr(pong[1]), "pong"),
	}
	peer.Stderr = os.Stderr
	if err := peer.Start(); err != nil {
		return nil, err
	}
	syscall.Close(ping[0])
	syscall.Close(pong[1])
	w, r := ping[1], pong[0]
	var one [1]byte
	trip := func() bool {
		if _, err := syscall.Write(w, one[:]); err != nil {
			return false
		}
		m, err := syscall.Read(r, one[:])
		return err == nil && m == 1
	}
	per := make([]float64, *rounds)
	for i := range per {
		t := time.Now()
		for j := 0; j < *n; j++ {
			if !trip() {
				return nil, fmt.Errorf("the peer stopped answering")
			}
		}
		per[i] = float64(time.Since(t).Nanoseconds()) / float64(*n)
	}
	syscall.Close(w) // the peer reads EOF and exits
	if err := peer.Wait(); err != nil {
		return nil, err
	}
	sort.Float64s(per)
	return &switchResult{Mode: "switch", RoundTrip: *n, Rounds: *rounds, SwitchNs: per[len(per)/2]}, nil
}

// switchPeer answers each byte on fd 3 with one on fd 4, until fd 3 is closed.
func switchPeer() {
	runtime.LockOSThread()
	var one [1]byte
	for {
		m, err := syscall.Read(3, one[:])
		if err != nil || m != 1 {
			return
		}
		if _, err := syscall.Write(4, one[:]); err != nil {
			return
		}
	}
}
