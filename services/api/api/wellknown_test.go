package api_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/services/api/api"
)

func TestWellKnownDocument(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	dir := t.TempDir()
	_, err := pki.Init(dir, pki.InitOptions{}, db.Now())
	require.NoError(t, err)
	srv, err := api.New(api.Config{PKI: service.PKI{PKIDir: dir}, WellKnown: api.WellKnownConfig{
		PublicURL: "https://compute.example", JoinURL: "https://join.compute.example",
		Gateways: service.Gateways{GatewayURL: "https://gw.compute.example:8443", GatewayServerName: "gw.compute.example"},
	}}, api.Deps{DB: db, Logger: telemetry.Discard()})
	require.NoError(t, err)
	ts := httptest.NewServer(srv.Handler())
	t.Cleanup(ts.Close)
	url := ts.URL + pki.WellKnownPath

	// Unauthenticated GET.
	resp, err := http.Get(url)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s", body)
	require.Equal(t, "application/json", resp.Header.Get("Content-Type"))
	require.Equal(t, "public, max-age=300", resp.Header.Get("Cache-Control"))
	etag := resp.Header.Get("ETag")
	require.NotEmpty(t, etag)

	var doc pki.WellKnown
	require.NoError(t, json.Unmarshal(body, &doc))
	require.Equal(t, "https://compute.example", doc.BaseURL)
	require.Equal(t, "https://join.compute.example", doc.JoinURL)
	require.Equal(t, pki.WellKnownGateway{URLs: []string{"https://gw.compute.example:8443"}, ServerName: "gw.compute.example"}, doc.Gateway)
	pins, err := pki.ReadPins(dir)
	require.NoError(t, err)
	require.Equal(t, pins, doc.Pins)
	// A daemon given the deployment's pins accepts its keys.
	keys, err := doc.JoinKeys(pins)
	require.NoError(t, err)
	_, signSPKI, err := pki.ReadJoinPublicKeys(dir)
	require.NoError(t, err)
	require.Equal(t, signSPKI, keys.SigningSPKI)
	// The command-signing root is published, so a daemon checks its
	// command-signing pin before it spends a join token.
	_, cmdSPKI, err := pki.LoadPublicKey(filepath.Join(dir, pki.CommandSigningPub))
	require.NoError(t, err)
	require.Equal(t, cmdSPKI, doc.CommandSigningKey)
	require.True(t, pki.MatchPin(pins.CommandSigning, doc.CommandSigningKey))
	// No private key is published.
	require.NotContains(t, string(body), "PRIVATE KEY")

	// Cacheable: a revalidation with the ETag is answered 304.
	req, err := http.NewRequest(http.MethodGet, url, nil)
	require.NoError(t, err)
	req.Header.Set("If-None-Match", etag)
	resp, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusNotModified, resp.StatusCode)

	// GET only.
	resp, err = http.Post(url, "application/json", nil)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	require.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)
}

func TestWellKnownBaseURLFromRequest(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	dir := t.TempDir()
	_, err := pki.Init(dir, pki.InitOptions{}, db.Now())
	require.NoError(t, err)
	srv, err := api.New(api.Config{PKI: service.PKI{PKIDir: dir}}, api.Deps{DB: db})
	require.NoError(t, err)
	rec := httptest.NewRecorder()
	srv.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "http://api.internal:8080"+pki.WellKnownPath, nil))
	require.Equal(t, http.StatusOK, rec.Code)
	var doc pki.WellKnown
	require.NoError(t, json.Unmarshal(rec.Body.Bytes(), &doc))
	require.Equal(t, "http://api.internal:8080", doc.BaseURL)
	require.Equal(t, "Host", rec.Header().Get("Vary"))
}

func TestWellKnownNeedsItsFiles(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	// Not configured: not served.
	srv, err := api.New(api.Config{}, api.Deps{DB: db})
	require.NoError(t, err)
	rec := httptest.NewRecorder()
	srv.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, pki.WellKnownPath, nil))
	require.Equal(t, http.StatusNotFound, rec.Code)

	// Configured with a broken PKI directory: the server does not start, and
	// says which file is missing.
	dir := t.TempDir()
	_, err = pki.Init(dir, pki.InitOptions{}, db.Now())
	require.NoError(t, err)
	require.NoError(t, os.Remove(filepath.Join(dir, pki.JoinSigningPub)))
	_, err = api.New(api.Config{PKI: service.PKI{PKIDir: dir}}, api.Deps{DB: db})
	require.ErrorContains(t, err, filepath.Join(dir, pki.JoinSigningPub))
}

// TestWellKnownRefusesBadGatewayURL: a malformed BETTER_COMPUTE_GATEWAY_URL fails New,
// naming the variable, rather than being published to every daemon.
func TestWellKnownRefusesBadGatewayURL(t *testing.T) {
	t.Parallel()
	db := storetest.New(t, clock.New())
	dir := t.TempDir()
	_, err := pki.Init(dir, pki.InitOptions{}, db.Now())
	require.NoError(t, err)
	for list, want := range map[string]string{
		"gw.compute.example:8443": `BETTER_COMPUTE_GATEWAY_URL: gateway URL "gw.compute.example:8443" must be https://HOST[:PORT]`,
		"http://gw:8443":          `BETTER_COMPUTE_GATEWAY_URL: gateway URL "http://gw:8443" must be https://HOST[:PORT]`,
		"https:///session":        `BETTER_COMPUTE_GATEWAY_URL: gateway URL "https:///session" has no host`,
	} {
		_, err := api.New(api.Config{PKI: service.PKI{PKIDir: dir}, WellKnown: api.WellKnownConfig{Gateways: service.Gateways{GatewayURL: list}}},
			api.Deps{DB: db, Logger: telemetry.Discard()})
		require.ErrorContains(t, err, want, list)
	}
}
