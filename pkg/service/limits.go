package service

import (
	"context"
	"net/http"
	"time"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/config"
)

// withDefaults returns l with its zero fields set to their defaults.
func (l HTTPLimits) withDefaults() HTTPLimits {
	config.SetDefaults(&l)
	return l
}

// deadlineClock sets the I/O deadlines of requests, which net/http measures
// in real time whatever clock a service runs on.
var deadlineClock = clock.New()

// requestDeadline is what requestDeadlines keeps in a request's context:
// its writer's controller and the server's HTTPRequestTimeout.
type requestDeadline struct {
	rc      *http.ResponseController
	timeout time.Duration
}

type requestDeadlineKey struct{}

// requestDeadlines bounds reading the body and writing the response of
// every request next serves to timeout from its start, through
// http.ResponseController (HTTP/1.1: the connection's deadlines, which the
// next request on it sets again; HTTP/2: the stream's), until its handler
// calls LongLived.
func requestDeadlines(next http.Handler, timeout time.Duration) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		d := &requestDeadline{rc: http.NewResponseController(w), timeout: timeout}
		at := deadlineClock.Now().Add(timeout)
		// net/http's writers support deadlines; another's errors leave
		// the request unbounded, as it was.
		_ = d.rc.SetReadDeadline(at)
		_ = d.rc.SetWriteDeadline(at)
		next.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), requestDeadlineKey{}, d)))
	})
}

// LongLived exempts the request of ctx, a long-lived stream (a session, a
// tunnel, a watch), from its server's HTTPRequestTimeout: it lifts the read
// and write deadlines set at the request's start. The stream's handler
// calls it before it streams, and bounds the stream otherwise (idle
// timeouts, BoundWrite). A WebSocket needs none: the upgrade takes the
// connection from the server, which lifts its deadlines (Hijack). It does
// nothing for a request of another server than NewServer's.
func LongLived(ctx context.Context) {
	if d, ok := ctx.Value(requestDeadlineKey{}).(*requestDeadline); ok {
		_ = d.rc.SetReadDeadline(time.Time{})
		_ = d.rc.SetWriteDeadline(time.Time{})
	}
}

// BoundWrite bounds the write that follows, of the long-lived stream of
// ctx (LongLived), to its server's HTTPRequestTimeout, so that a client that
// stops reading does not hold the stream's handler forever: the write fails
// then, and the stream with it. Call the function it returns once the write
// (and its flush) returned: it lifts the write deadline, so that the stream
// may wait for something to send. It does nothing for a request of another
// server than NewServer's.
func BoundWrite(ctx context.Context) (done func()) {
	d, ok := ctx.Value(requestDeadlineKey{}).(*requestDeadline)
	if !ok {
		return func() {}
	}
	_ = d.rc.SetWriteDeadline(deadlineClock.Now().Add(d.timeout))
	return func() { _ = d.rc.SetWriteDeadline(time.Time{}) }
}
