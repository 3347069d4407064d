package pki_test

import (
	"strings"
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
		{"https://a:8443", pki.WellKnownGateway{URLs: []string{"https://a:8443"}, ServerName: "gw"}},
		{" https://a:8443 , ,https://b:8443,", pki.WellKnownGateway{
			URLs: []string{"https://a:8443", "https://b:8443"}, ServerName: "gw"}},
	} {
		require.Equal(t, tc.want, pki.NewWellKnownGateway(tc.list, "gw"), "list %q", tc.list)
	}
}

// TestParseGatewayURLs: a gateway URL list is https URLs with a host; a
// malformed one is refused, the error quoting it and saying what is wrong.
func TestParseGatewayURLs(t *testing.T) {
	t.Parallel()
	urls, err := pki.ParseGatewayURLs(" https://gw-a:8443 ,https://gw-b.example, https://[::1]:8443/session")
	require.NoError(t, err)
	require.Equal(t, []string{"https://gw-a:8443", "https://gw-b.example", "https://[::1]:8443/session"}, urls)
	for _, empty := range []string{"", "  "} {
		urls, err = pki.ParseGatewayURLs(empty)
		require.NoError(t, err)
		require.Nil(t, urls)
	}

	for list, want := range map[string]string{
		"gateway:8443":                 `gateway URL "gateway:8443" must be https://HOST[:PORT]`,
		"gateway":                      `gateway URL "gateway" must be https://HOST[:PORT]`,
		"http://gateway:8443":          `gateway URL "http://gateway:8443" must be https://HOST[:PORT] (the session uses mutual TLS)`,
		"ftp://gateway":                `gateway URL "ftp://gateway" must be https://HOST[:PORT]`,
		"https://":                     `gateway URL "https://" has no host`,
		"https://:8443":                `gateway URL "https://:8443" has no host`,
		"https:///session":             `gateway URL "https:///session" has no host`,
		"https://gw:0":                 `gateway URL "https://gw:0" has a bad port "0"`,
		"https://gw:99999":             `gateway URL "https://gw:99999" has a bad port "99999"`,
		"https://gw:84 43":             `gateway URL "https://gw:84 43" does not parse`,
		"https://gw-a:8443,gw-b:8443":  `gateway URL "gw-b:8443" must be https://HOST[:PORT]`,
		"https://gw-a:8443, http://gw": `gateway URL "http://gw" must be https://HOST[:PORT]`,
		" , ,":                         `gateway URL list " , ," has no URL`,
		"https://gw:8443?x=1":          `gateway URL "https://gw:8443?x=1" has a query or fragment`,
		"https://gw:8443?":             `gateway URL "https://gw:8443?" has a query or fragment`,
		"https://gw:8443#frag":         `gateway URL "https://gw:8443#frag" has a query or fragment`,
		"https://gw:8443/#":            `gateway URL "https://gw:8443/#" has a query or fragment`,
	} {
		_, err := pki.ParseGatewayURLs(list)
		require.ErrorContains(t, err, want, list)
	}
}

// TestParsePinTakesOneSpelling: a pin is the one spelling PinOfSPKI
// writes; base64 with line breaks or non-zero padding bits decodes to the
// same digest but is refused, so that one key has one pin.
func TestParsePinTakesOneSpelling(t *testing.T) {
	t.Parallel()
	const alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"
	pin := pki.PinOfSPKI([]byte("spki"))
	sum, err := pki.ParsePin(pin)
	require.NoError(t, err)
	require.Len(t, sum, 32)
	for _, bad := range []string{
		pin[:20] + "\n" + pin[20:],
		pin[:20] + "\r\n" + pin[20:],
		pin[:len(pin)-2] + string(alphabet[strings.IndexByte(alphabet, pin[len(pin)-2])|1]) + "=", // a padding bit set
		pin[:len(pin)-1],
	} {
		_, err := pki.ParsePin(bad)
		require.ErrorContains(t, err, "is not base64 of a SHA-256 digest", "%q", bad)
		require.False(t, pki.MatchPin(bad, []byte("spki")), "%q", bad)
	}
}
