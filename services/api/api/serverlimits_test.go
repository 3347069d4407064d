package api_test

import (
	"bufio"
	"context"
	"crypto/tls"
	"net/http"
	"net/url"
	"strconv"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/service/servicetest"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/api/api"
	"github.com/better-compute/better-compute/services/api/apitest"
)

// TestWatchesOutliveRequestTimeout checks that both events watches,
// long-lived streams, last past several of HTTPRequestTimeout, which bounds
// the unary calls only.
func TestWatchesOutliveRequestTimeout(t *testing.T) {
	t.Parallel()
	const timeout = 300 * time.Millisecond
	f := setup(t)
	g := *f
	g.url = apitest.StartWith(t, f.db, api.Config{HTTPLimits: service.HTTPLimits{HTTPRequestTimeout: timeout}})
	token := f.tokens["acme-viewer"]
	after := mark(t, f.db, f.acme)
	stream := watch(t, g.as(token), &computev1.WatchRequest{AfterId: after})
	res := g.getWatch(t.Context(), t, token, url.Values{"after": {strconv.FormatInt(after, 10)}})
	defer res.Body.Close()
	require.Equal(t, http.StatusOK, res.StatusCode)

	<-clock.New().NewTimer(4 * timeout).C()
	id := insertEvent(t, f.db, nil, f.db.Now(), f.acme, "node.cordoned")
	require.Equal(t, id, stream.next(t).GetId(), "the Connect watch is up")
	require.Equal(t, []int64{id}, ndjsonIDs(t, bufio.NewScanner(res.Body), 1), "the NDJSON watch is up")

	// A unary call still has the whole timeout.
	_, err := g.as(token).pools.ListSites(t.Context(), connect.NewRequest(&computev1.ListSitesRequest{}))
	require.NoError(t, err)
}

// TestTunnelOutlivesRequestTimeout checks that a tunnel's WebSocket, which
// takes its connection from the server, lasts past several of
// HTTPRequestTimeout.
func TestTunnelOutlivesRequestTimeout(t *testing.T) {
	t.Parallel()
	const timeout = 300 * time.Millisecond
	f := setup(t)
	g := *f
	g.url = apitest.StartWith(t, f.db, api.Config{PKI: service.PKI{PKIDir: f.pkiDir},
		HTTPLimits: service.HTTPLimits{HTTPRequestTimeout: timeout}})
	gw := f.startGateway(t, "gw-limits")
	node := f.liveNode(t, gw.id)
	ws := g.open(t, g.ticket(t, "acme-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"}), "")
	<-gw.starts
	<-clock.New().NewTimer(4 * timeout).C()
	send(t, ws, dataFrame("hello"))
	require.Equal(t, "hello", string(next(t, ws).GetData()))
}

// TestServeTLS checks that with TLS_CERT and TLS_KEY the API serves HTTPS,
// HTTP/2 by ALPN, which a Connect client calls.
func TestServeTLS(t *testing.T) {
	t.Parallel()
	f := setup(t)
	setting, roots := servicetest.ServingCert(t, "", "127.0.0.1")
	base := apitest.StartWith(t, f.db, api.Config{TLS: setting})
	require.Regexp(t, `^https://`, base)

	var p http.Protocols
	p.SetHTTP2(true)
	tr := &http.Transport{Protocols: &p, TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}
	t.Cleanup(tr.CloseIdleConnections)
	var proto string
	hc := &http.Client{Transport: roundTripFunc(func(r *http.Request) (*http.Response, error) {
		res, err := tr.RoundTrip(r)
		if err == nil {
			proto = res.Proto
		}
		return res, err
	})}
	pools := computev1connect.NewPoolServiceClient(hc, base+api.PathPrefix, connect.WithInterceptors(bearer(f.tokens["acme-viewer"])))
	res, err := pools.ListSites(t.Context(), connect.NewRequest(&computev1.ListSitesRequest{}))
	require.NoError(t, err)
	require.Len(t, res.Msg.GetSites(), 1)
	require.Equal(t, "HTTP/2.0", proto)

	ready, err := hc.Get(base + "/readyz")
	require.NoError(t, err)
	require.NoError(t, ready.Body.Close())
	require.Equal(t, http.StatusOK, ready.StatusCode, "the probes are served over TLS too")
}

// TestTLSNeedsBothFiles checks that the API does not start with one of
// TLS_CERT and TLS_KEY without the other, naming the missing one.
func TestTLSNeedsBothFiles(t *testing.T) {
	t.Parallel()
	f := setup(t)
	setting, _ := servicetest.ServingCert(t, "", "127.0.0.1")
	for _, c := range []struct {
		name    string
		setting service.TLS
		missing string
	}{
		{name: "cert alone", setting: service.TLS{TLSCert: setting.TLSCert}, missing: "BETTER_COMPUTE_TLS_KEY"},
		{name: "key alone", setting: service.TLS{TLSKey: setting.TLSKey}, missing: "BETTER_COMPUTE_TLS_CERT"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			_, err := api.New(api.Config{TLS: c.setting}, api.Deps{DB: f.db, Logger: telemetry.Discard()})
			require.ErrorContains(t, err, c.missing)
		})
	}
}

type roundTripFunc func(*http.Request) (*http.Response, error)

func (f roundTripFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// bearer sends token as the bearer token of unary calls.
func bearer(token string) connect.UnaryInterceptorFunc {
	return func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			req.Header().Set("Authorization", "Bearer "+token)
			return next(ctx, req)
		}
	}
}
