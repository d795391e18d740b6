// Command rls-client drives an Envoy rate limit service (envoy.service.ratelimit.v3.RateLimitService)
// and grpc.health.v1 from outside, with Envoy's own published Go protos and grpc-go, so Sluice's
// server is checked against a client it did not write (and the same client can drive the peer,
// envoyproxy/ratelimit, in benchmarks).
//
// rls-client stdio -addr HOST:PORT [-tls-ca PEM] [-server-name NAME]
//
// One JSON command per stdin line, exactly one JSON answer line per command on stdout, exit 0 at EOF.
// Blank lines are skipped. Commands (unknown fields are rejected, so a typo in a test fails loudly):
//
//	{"op":"rls","domain":"d","descriptors":[{"entries":[{"key":"k","value":"v"}],
//	  "limit":{"requests_per_unit":N,"unit":"SECOND"}}],"hits_addend":N,"timeout_ms":N,"token":"T",
//	  "wait_for_ready":false}
//	{"op":"health","service":"","timeout_ms":N}
//	{"op":"watch_health","service":"","timeout_ms":N}   (answers with the first streamed status)
//
// limit.unit takes the names of envoy.type.v3.RateLimitUnit (UNKNOWN SECOND MINUTE HOUR DAY MONTH
// YEAR: that enum has no WEEK, only the response's unit does). hits_addend 0 or absent leaves it
// unset. timeout_ms absent means 1000; 0 means no deadline, so no grpc-timeout header is sent.
// token, on any op, sends metadata "x-sluice-authorization: Bearer T". wait_for_ready makes the call
// wait (up to its deadline) for a connection instead of failing fast with Unavailable.
//
// Answers:
//
//	{"ok":true,"overall_code":"OK","statuses":[{"code":"OK","current_limit":{"name":"","requests_per_unit":N,
//	  "unit":"MINUTE"}|null,"limit_remaining":N,"duration_until_reset_ms":N|null}],
//	  "response_headers_to_add":[{"key":"","value":""}],"request_headers_to_add":[],"elapsed_us":N}
//	{"ok":true,"status":"SERVING","elapsed_us":N}
//	{"ok":false,"grpc_code":"Unavailable","message":"...","elapsed_us":N}
//	{"ok":false,"grpc_code":"","message":"bad command: ..."}
//
// grpc_code is status.Code(err).String() from grpc-go, i.e. codes.Code's Go names in CamelCase:
// OK Canceled Unknown InvalidArgument DeadlineExceeded NotFound AlreadyExists PermissionDenied
// ResourceExhausted FailedPrecondition Aborted OutOfRange Unimplemented Internal Unavailable
// DataLoss Unauthenticated (not the proto's DEADLINE_EXCEEDED style).
//
// rls-client bench -addr HOST:PORT [-conns 4] [-concurrency 64] [-duration 10s] [-warmup 2s]
//
//	[-descriptors 1|2|3] [-keys 10000] [-domain bench] [-token T] [-tls-ca PEM] [-timeout 1s]
//
// prints one line: {"requests":N,"ok":N,"over_limit":N,"errors":N,"rps":F,"p50_us":F,"p99_us":F,
// "p999_us":F,"seconds":F}, counting only calls that completed inside the measured window (after
// warmup). A response whose overall_code is UNKNOWN counts as an error.
package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/bits"
	"math/rand/v2"
	"os"
	"strconv"
	"sync"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	typev3 "github.com/envoyproxy/go-control-plane/envoy/type/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

const authHeader = "x-sluice-authorization"

type connFlags struct {
	addr, tlsCA, serverName string
}

func (c *connFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&c.addr, "addr", "", "server address, HOST:PORT")
	fs.StringVar(&c.tlsCA, "tls-ca", "", "PEM CA bundle; when set, connect with TLS verified against it")
	fs.StringVar(&c.serverName, "server-name", "localhost", "TLS server name to verify (with -tls-ca)")
}

// dial makes a ClientConn without connecting: grpc.NewClient connects on the first call, so a
// client started before its server still works once the server is up.
func (c *connFlags) dial() (*grpc.ClientConn, error) {
	if c.addr == "" {
		return nil, errors.New("-addr is required")
	}
	creds := insecure.NewCredentials()
	if c.tlsCA != "" {
		var err error
		if creds, err = credentials.NewClientTLSFromFile(c.tlsCA, c.serverName); err != nil {
			return nil, err
		}
	}
	// The default reconnect backoff grows to 120 s; tests restart servers and should not wait that long.
	bc := backoff.DefaultConfig
	bc.MaxDelay = time.Second
	return grpc.NewClient(c.addr, grpc.WithTransportCredentials(creds),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: bc, MinConnectTimeout: time.Second}))
}

// ---- stdio ----

type entry struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

type limitIn struct {
	RequestsPerUnit uint32 `json:"requests_per_unit"`
	Unit            string `json:"unit"`
}

type descriptorIn struct {
	Entries []entry  `json:"entries"`
	Limit   *limitIn `json:"limit"`
}

type command struct {
	Op           string         `json:"op"`
	Domain       string         `json:"domain"`
	Descriptors  []descriptorIn `json:"descriptors"`
	HitsAddend   uint32         `json:"hits_addend"`
	TimeoutMs    *int64         `json:"timeout_ms"`
	Token        *string        `json:"token"`
	Service      string         `json:"service"`
	WaitForReady bool           `json:"wait_for_ready"`
}

type header struct {
	Key   string `json:"key"`
	Value string `json:"value"`
}

type limitOut struct {
	Name            string `json:"name"`
	RequestsPerUnit uint32 `json:"requests_per_unit"`
	Unit            string `json:"unit"`
}

type statusOut struct {
	Code                 string    `json:"code"`
	CurrentLimit         *limitOut `json:"current_limit"`
	LimitRemaining       uint32    `json:"limit_remaining"`
	DurationUntilResetMs *int64    `json:"duration_until_reset_ms"`
}

type rlsAnswer struct {
	OK                   bool        `json:"ok"`
	OverallCode          string      `json:"overall_code"`
	Statuses             []statusOut `json:"statuses"`
	ResponseHeadersToAdd []header    `json:"response_headers_to_add"`
	RequestHeadersToAdd  []header    `json:"request_headers_to_add"`
	ElapsedUs            int64       `json:"elapsed_us"`
}

type healthAnswer struct {
	OK        bool   `json:"ok"`
	Status    string `json:"status"`
	ElapsedUs int64  `json:"elapsed_us"`
}

type errAnswer struct {
	OK        bool   `json:"ok"`
	GrpcCode  string `json:"grpc_code"`
	Message   string `json:"message"`
	ElapsedUs *int64 `json:"elapsed_us,omitempty"` // absent for bad commands: nothing was sent
}

func badCommand(format string, args ...any) errAnswer {
	return errAnswer{Message: "bad command: " + fmt.Sprintf(format, args...)}
}

func rpcError(err error, elapsed time.Duration) errAnswer {
	us := elapsed.Microseconds()
	st := status.Convert(err)
	return errAnswer{GrpcCode: st.Code().String(), Message: st.Message(), ElapsedUs: &us}
}

func headers(hs []*corev3.HeaderValue) []header {
	out := make([]header, 0, len(hs)) // [] rather than null, so callers can index without checks
	for _, h := range hs {
		out = append(out, header{Key: h.GetKey(), Value: h.GetValue()})
	}
	return out
}

func buildRequest(c *command) (*rlsv3.RateLimitRequest, error) {
	req := &rlsv3.RateLimitRequest{Domain: c.Domain, HitsAddend: c.HitsAddend}
	for i, d := range c.Descriptors {
		desc := &ratelimitv3.RateLimitDescriptor{}
		for _, e := range d.Entries {
			desc.Entries = append(desc.Entries, &ratelimitv3.RateLimitDescriptor_Entry{Key: e.Key, Value: e.Value})
		}
		if d.Limit != nil {
			unit, ok := typev3.RateLimitUnit_value[d.Limit.Unit]
			if !ok {
				return nil, fmt.Errorf("descriptors[%d].limit.unit %q is not an envoy.type.v3.RateLimitUnit name", i, d.Limit.Unit)
			}
			desc.Limit = &ratelimitv3.RateLimitDescriptor_RateLimitOverride{
				RequestsPerUnit: d.Limit.RequestsPerUnit, Unit: typev3.RateLimitUnit(unit)}
		}
		req.Descriptors = append(req.Descriptors, desc)
	}
	return req, nil
}

func rlsAnswerFrom(resp *rlsv3.RateLimitResponse, elapsed time.Duration) rlsAnswer {
	a := rlsAnswer{
		OK:                   true,
		OverallCode:          resp.GetOverallCode().String(),
		Statuses:             make([]statusOut, 0, len(resp.GetStatuses())),
		ResponseHeadersToAdd: headers(resp.GetResponseHeadersToAdd()),
		RequestHeadersToAdd:  headers(resp.GetRequestHeadersToAdd()),
		ElapsedUs:            elapsed.Microseconds(),
	}
	for _, s := range resp.GetStatuses() {
		o := statusOut{Code: s.GetCode().String(), LimitRemaining: s.GetLimitRemaining()}
		if l := s.GetCurrentLimit(); l != nil {
			o.CurrentLimit = &limitOut{Name: l.GetName(), RequestsPerUnit: l.GetRequestsPerUnit(), Unit: l.GetUnit().String()}
		}
		if d := s.GetDurationUntilReset(); d != nil {
			ms := d.AsDuration().Milliseconds()
			o.DurationUntilResetMs = &ms
		}
		a.Statuses = append(a.Statuses, o)
	}
	return a
}

// handle runs one command line and returns the value to print.
func handle(line []byte, conn *grpc.ClientConn) any {
	var c command
	dec := json.NewDecoder(bytes.NewReader(line))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return badCommand("%v", err)
	}
	if dec.More() {
		return badCommand("trailing data after the JSON object")
	}
	ctx := context.Background()
	timeout := int64(1000)
	if c.TimeoutMs != nil {
		timeout = *c.TimeoutMs
	}
	if timeout < 0 {
		return badCommand("timeout_ms must be >= 0")
	}
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(timeout)*time.Millisecond)
		defer cancel()
	}
	if c.Token != nil {
		ctx = metadata.AppendToOutgoingContext(ctx, authHeader, "Bearer "+*c.Token)
	}
	opts := []grpc.CallOption{grpc.WaitForReady(c.WaitForReady)}

	switch c.Op {
	case "rls":
		req, err := buildRequest(&c)
		if err != nil {
			return badCommand("%v", err)
		}
		start := time.Now()
		resp, err := rlsv3.NewRateLimitServiceClient(conn).ShouldRateLimit(ctx, req, opts...)
		elapsed := time.Since(start)
		if err != nil {
			return rpcError(err, elapsed)
		}
		return rlsAnswerFrom(resp, elapsed)
	case "health":
		start := time.Now()
		resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: c.Service}, opts...)
		elapsed := time.Since(start)
		if err != nil {
			return rpcError(err, elapsed)
		}
		return healthAnswer{OK: true, Status: resp.GetStatus().String(), ElapsedUs: elapsed.Microseconds()}
	case "watch_health":
		// Cancelling ends the stream once the first status is in: the server sees a client cancel.
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		start := time.Now()
		stream, err := healthpb.NewHealthClient(conn).Watch(ctx, &healthpb.HealthCheckRequest{Service: c.Service}, opts...)
		var resp *healthpb.HealthCheckResponse
		if err == nil {
			resp, err = stream.Recv()
		}
		elapsed := time.Since(start)
		if err != nil {
			return rpcError(err, elapsed)
		}
		return healthAnswer{OK: true, Status: resp.GetStatus().String(), ElapsedUs: elapsed.Microseconds()}
	default:
		return badCommand("unknown op %q (want rls, health or watch_health)", c.Op)
	}
}

func runStdio(args []string) error {
	fs := flag.NewFlagSet("stdio", flag.ExitOnError)
	var cf connFlags
	cf.register(fs)
	_ = fs.Parse(args)
	conn, err := cf.dial()
	if err != nil {
		return err
	}
	defer conn.Close()

	in := bufio.NewReader(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	enc := json.NewEncoder(out) // Encode appends the newline
	enc.SetEscapeHTML(false)
	for {
		line, readErr := in.ReadBytes('\n') // no line-length limit, unlike bufio.Scanner
		if len(bytes.TrimSpace(line)) > 0 {
			if err := enc.Encode(handle(line, conn)); err != nil {
				return err
			}
			// The caller waits for each answer before sending the next command.
			if err := out.Flush(); err != nil {
				return err
			}
		}
		if readErr == io.EOF {
			return nil
		}
		if readErr != nil {
			return readErr
		}
	}
}

// ---- bench ----

// histogram is log-linear like HdrHistogram: values below 2^subBits nanoseconds are exact, above
// that each power of two is split into 2^subBits buckets, so any value is off by under 1/128
// (0.8%). Fixed size, so recording never allocates; one per goroutine, merged at the end.
const (
	subBits  = 7
	maxShift = 40 // values past 2^(subBits+maxShift) ns (about 39 h) are clamped
)

type histogram struct {
	counts [(maxShift + 2) << subBits]uint64
	total  uint64
}

func bucketOf(ns uint64) int {
	if ns < 1<<subBits {
		return int(ns)
	}
	shift := bits.Len64(ns) - 1 - subBits
	if shift > maxShift {
		return len(histogram{}.counts) - 1
	}
	return shift<<subBits + int(ns>>uint(shift)) // ns>>shift is in [2^subBits, 2^(subBits+1))
}

// midpoint of bucket i, in nanoseconds
func bucketValue(i int) float64 {
	if i < 2<<subBits {
		return float64(i)
	}
	shift := i>>subBits - 1
	low := uint64(i-shift<<subBits) << uint(shift)
	return float64(low) + float64(uint64(1)<<uint(shift)-1)/2
}

func (h *histogram) record(d time.Duration) {
	h.counts[bucketOf(uint64(max(d, 0)))]++
	h.total++
}

func (h *histogram) merge(o *histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.total += o.total
}

// quantileUs is the smallest bucket value at or below which a fraction q of the samples fall.
func (h *histogram) quantileUs(q float64) float64 {
	if h.total == 0 {
		return 0
	}
	target := uint64(math.Ceil(q * float64(h.total)))
	var seen uint64
	for i, c := range h.counts {
		if seen += c; seen >= max(target, 1) {
			return bucketValue(i) / 1e3
		}
	}
	return bucketValue(len(h.counts)-1) / 1e3
}

type worker struct {
	hist                histogram
	ok, overLimit, errs uint64
	firstErr            error
}

type benchResult struct {
	Requests  uint64  `json:"requests"`
	OK        uint64  `json:"ok"`
	OverLimit uint64  `json:"over_limit"`
	Errors    uint64  `json:"errors"`
	RPS       float64 `json:"rps"`
	P50Us     float64 `json:"p50_us"`
	P99Us     float64 `json:"p99_us"`
	P999Us    float64 `json:"p999_us"`
	Seconds   float64 `json:"seconds"`
}

func runBench(args []string) error {
	fs := flag.NewFlagSet("bench", flag.ExitOnError)
	var cf connFlags
	cf.register(fs)
	conns := fs.Int("conns", 4, "client connections (HTTP/2 connections) to spread goroutines over")
	concurrency := fs.Int("concurrency", 64, "goroutines, each with one call in flight")
	duration := fs.Duration("duration", 10*time.Second, "measured window")
	warmup := fs.Duration("warmup", 2*time.Second, "unmeasured run before the window")
	ndesc := fs.Int("descriptors", 1, "descriptors per request, 1-3 (api_key, remote_address, path)")
	keys := fs.Int("keys", 10000, "distinct key indexes, drawn uniformly")
	domain := fs.String("domain", "bench", "rate limit domain")
	token := fs.String("token", "", "send x-sluice-authorization: Bearer TOKEN")
	timeout := fs.Duration("timeout", time.Second, "per-call deadline")
	_ = fs.Parse(args)
	switch {
	case *conns < 1 || *concurrency < 1 || *keys < 1:
		return errors.New("-conns, -concurrency and -keys must be >= 1")
	case *ndesc < 1 || *ndesc > 3:
		return errors.New("-descriptors must be 1, 2 or 3")
	case *duration <= 0 || *warmup < 0:
		return errors.New("-duration must be > 0 and -warmup >= 0")
	}

	cc := make([]*grpc.ClientConn, *conns)
	for i := range cc {
		c, err := cf.dial()
		if err != nil {
			return err
		}
		defer c.Close()
		// Connect now, so the handshake is not the warmup's first latency.
		c.Connect()
		cc[i] = c
	}

	ctx := context.Background()
	if *token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, authHeader, "Bearer "+*token)
	}
	begin := time.Now()
	measureFrom := begin.Add(*warmup)
	end := measureFrom.Add(*duration)
	workers := make([]*worker, *concurrency) // separate allocations: no false sharing of counters
	var wg sync.WaitGroup
	for g := range workers {
		w := &worker{}
		workers[g] = w
		client := rlsv3.NewRateLimitServiceClient(cc[g%len(cc)])
		wg.Go(func() { w.loop(ctx, client, *domain, *ndesc, *keys, *timeout, measureFrom, end) })
	}
	wg.Wait()

	var total worker
	for _, w := range workers {
		total.hist.merge(&w.hist)
		total.ok += w.ok
		total.overLimit += w.overLimit
		total.errs += w.errs
		if total.firstErr == nil {
			total.firstErr = w.firstErr
		}
	}
	if total.firstErr != nil {
		st := status.Convert(total.firstErr)
		fmt.Fprintf(os.Stderr, "rls-client bench: %d errors, e.g. %s: %s\n", total.errs, st.Code(), st.Message())
	}
	secs := duration.Seconds()
	n := total.ok + total.overLimit + total.errs
	res := benchResult{
		Requests: n, OK: total.ok, OverLimit: total.overLimit, Errors: total.errs,
		RPS: float64(n) / secs, P50Us: total.hist.quantileUs(0.50), P99Us: total.hist.quantileUs(0.99),
		P999Us: total.hist.quantileUs(0.999), Seconds: secs,
	}
	return json.NewEncoder(os.Stdout).Encode(res)
}

// loop keeps one call in flight until end. Only calls that complete within [measureFrom, end)
// count, so the rate is completions per second of the window and in-flight calls at either edge
// do not inflate it.
func (w *worker) loop(ctx context.Context, client rlsv3.RateLimitServiceClient, domain string,
	ndesc, keys int, timeout time.Duration, measureFrom, end time.Time) {
	// One request reused for every call (grpc-go is done with it once the call returns); only the
	// entry values change.
	names := [3]string{"api_key", "remote_address", "path"}
	entries := make([]*ratelimitv3.RateLimitDescriptor_Entry, ndesc)
	req := &rlsv3.RateLimitRequest{Domain: domain}
	for i := range entries {
		entries[i] = &ratelimitv3.RateLimitDescriptor_Entry{Key: names[i], Value: "/orders"}
		req.Descriptors = append(req.Descriptors,
			&ratelimitv3.RateLimitDescriptor{Entries: []*ratelimitv3.RateLimitDescriptor_Entry{entries[i]}})
	}
	for {
		n := rand.IntN(keys)
		entries[0].Value = "key-" + strconv.Itoa(n)
		if ndesc > 1 {
			entries[1].Value = "10.0." + strconv.Itoa(n/256%256) + "." + strconv.Itoa(n%256)
		}
		cctx, cancel := context.WithTimeout(ctx, timeout)
		start := time.Now()
		resp, err := client.ShouldRateLimit(cctx, req)
		done := time.Now()
		cancel()
		if !done.Before(end) {
			return
		}
		if done.Before(measureFrom) {
			continue
		}
		w.hist.record(done.Sub(start))
		switch {
		case err != nil:
			w.errs++
			if w.firstErr == nil {
				w.firstErr = err
			}
		case resp.GetOverallCode() == rlsv3.RateLimitResponse_OK:
			w.ok++
		case resp.GetOverallCode() == rlsv3.RateLimitResponse_OVER_LIMIT:
			w.overLimit++
		default:
			w.errs++
			if w.firstErr == nil {
				w.firstErr = fmt.Errorf("overall_code %s", resp.GetOverallCode())
			}
		}
	}
}

func main() {
	usage := "usage: rls-client stdio -addr HOST:PORT [-tls-ca PEM] [-server-name NAME]\n" +
		"       rls-client bench -addr HOST:PORT [-conns N] [-concurrency N] [-duration D] [-warmup D]\n" +
		"                        [-descriptors 1-3] [-keys N] [-domain D] [-token T] [-tls-ca PEM] [-timeout D]\n"
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "stdio":
		err = runStdio(os.Args[2:])
	case "bench":
		err = runBench(os.Args[2:])
	default:
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "rls-client %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}
