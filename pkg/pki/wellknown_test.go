package pki_test

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/pki"
)

func TestNewWellKnownGateway(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		list string
		want pki.WellKnownGateway
	}{
		{"", pki.WellKnownGateway{ServerName: "gw"}},
		{"https://a:8443", pki.WellKnownGateway{URL: "https://a:8443", ServerName: "gw"}},
		{" https://a:8443 , ,https://b:8443,", pki.WellKnownGateway{URL: "https://a:8443",
			URLs: []string{"https://a:8443", "https://b:8443"}, ServerName: "gw"}},
	} {
		require.Equal(t, tc.want, pki.NewWellKnownGateway(tc.list, "gw"), "list %q", tc.list)
	}
}
