// Package servicetest holds test helpers for the settings pkg/service
// shares among services. Tests of every service use it; it is imported by
// tests only.
package servicetest

import (
	"crypto/x509"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
)

// ServingCert writes a serving certificate for hosts (DNS names or IP
// addresses, as pki.CA.IssueServing takes them), valid for an hour from
// now on the real clock, into a temporary directory of t, and returns the
// TLS setting of its files (serving.crt, serving.key) and a pool trusting
// its CA. The CA is the serving CA of pkiDir (pki.ServingCACert and
// pki.ServingCAKey), or a fresh one when pkiDir is "". It fails t on any
// error.
func ServingCert(t testing.TB, pkiDir string, hosts ...string) (service.TLS, *x509.CertPool) {
	t.Helper()
	now := clock.New().Now()
	if pkiDir == "" {
		pkiDir = t.TempDir()
		_, err := pki.Init(pkiDir, pki.InitOptions{}, now)
		require.NoError(t, err)
	}
	ca, err := pki.LoadCA(filepath.Join(pkiDir, pki.ServingCACert), filepath.Join(pkiDir, pki.ServingCAKey))
	require.NoError(t, err)
	cert, key, err := ca.IssueServing(hosts, now, time.Hour)
	require.NoError(t, err)
	dir := t.TempDir()
	s := service.TLS{TLSCert: filepath.Join(dir, "serving.crt"), TLSKey: filepath.Join(dir, "serving.key")}
	require.NoError(t, pki.WriteCert(s.TLSCert, cert))
	require.NoError(t, pki.WriteKey(s.TLSKey, key))
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	return s, roots
}
