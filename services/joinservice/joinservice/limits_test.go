package joinservice_test

import (
	"crypto/tls"
	"crypto/x509"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/service"
	"github.com/better-compute/better-compute/pkg/service/servicetest"
	"github.com/better-compute/better-compute/services/joinservice/joinservice"
)

// TestServeTLS checks that with TLS_CERT and TLS_KEY JoinService serves
// HTTPS, HTTP/2 by ALPN, where a machine joins.
func TestServeTLS(t *testing.T) {
	t.Parallel()
	var setting service.TLS
	var roots *x509.CertPool
	f := setupWith(t, func(c *joinservice.Config) {
		setting, roots = servicetest.ServingCert(t, c.PKIDir, "127.0.0.1")
		c.TLS = setting
	})
	var p http.Protocols
	p.SetHTTP2(true)
	tr := &http.Transport{Protocols: &p, TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12}}
	t.Cleanup(tr.CloseIdleConnections)
	client := joinv1connect.NewJoinServiceClient(&http.Client{Transport: tr}, "https"+strings.TrimPrefix(f.url, "http"))
	_, secret := f.token(t, 1, f.db.Now().Add(time.Hour))
	res, err := client.Join(t.Context(), connect.NewRequest(f.request(t, secret, nil)))
	require.NoError(t, err)
	require.NotEmpty(t, res.Msg.GetNodeId())

	_, err = f.client.Join(t.Context(), connect.NewRequest(f.request(t, secret, nil)))
	require.Error(t, err, "nothing is served in clear")
}

// TestTLSNeedsBothFiles checks that JoinService does not start with one of
// TLS_CERT and TLS_KEY without the other, naming the missing one.
func TestTLSNeedsBothFiles(t *testing.T) {
	t.Parallel()
	f := setup(t)
	setting, _ := servicetest.ServingCert(t, f.pkiDir, "127.0.0.1")
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
			_, err := joinservice.New(joinservice.Config{PKI: service.PKI{PKIDir: f.pkiDir}, TLS: c.setting,
				Gateways: service.Gateways{GatewayURL: "https://gw.example:8443"}}, joinservice.Deps{DB: f.db})
			require.ErrorContains(t, err, c.missing)
		})
	}
}
