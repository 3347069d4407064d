package iam_test

import (
	"encoding/base64"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/iam"
)

// A well-formed token: "bct_" and 32 bytes in unpadded base64url.
const goodToken = "bct_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8"

func TestParseBearer(t *testing.T) {
	t.Parallel()
	fresh, err := iam.NewSecret(iam.APITokenPrefix)
	require.NoError(t, err)
	for _, header := range []string{"Bearer " + goodToken, "bearer " + goodToken, "BEARER " + goodToken,
		"Bearer   " + goodToken, "Bearer " + fresh} {
		secret, err := iam.ParseBearer(header)
		require.NoError(t, err, header)
		require.Equal(t, header[strings.LastIndex(header, " ")+1:], secret)
	}
	for _, tc := range []struct{ header, msg string }{
		{"", "missing bearer token"},
		{goodToken, "authorization header must be"},
		{"Bearer", "authorization header must be"},
		{"Basic " + goodToken, "authorization header must be"},
		{"Bearer\t" + goodToken, "authorization header must be"},
		{" Bearer " + goodToken, "authorization header must be"},
		{"Bearer ", "api token is not valid"},
		{"Bearer bct_", "api token is not valid"},
		{"Bearer bcjt_" + goodToken[4:], "api token is not valid"},                    // a join token's prefix
		{"Bearer " + goodToken[:len(goodToken)-1], "api token is not valid"},          // 42 characters
		{"Bearer " + goodToken + "A", "api token is not valid"},                       // 44 characters
		{"Bearer " + goodToken + " ", "api token is not valid"},                       // trailing space
		{"Bearer " + goodToken[:len(goodToken)-1] + "9", "api token is not valid"},    // stray low bits: not canonical
		{"Bearer " + goodToken[:10] + "+" + goodToken[11:], "api token is not valid"}, // standard, not URL, alphabet
		{"Bearer " + goodToken[:10] + "=" + goodToken[11:], "api token is not valid"},
		{"Bearer " + goodToken[:10] + "\n" + goodToken[11:], "api token is not valid"}, // base64 would skip it
		{"Bearer " + goodToken[:40] + "==", "api token is not valid"},
		{"Bearer " + goodToken + "\x00", "api token is not valid"},
		{"Bearer " + strings.Repeat("A", 1<<16), "api token is not valid"},
	} {
		secret, err := iam.ParseBearer(tc.header)
		require.ErrorIs(t, err, iam.ErrUnauthenticated, "%q", tc.header)
		require.ErrorContains(t, err, tc.msg, "%q", tc.header)
		require.Empty(t, secret)
	}
}

// wellFormed is ParseBearer's contract, written independently: a
// case-insensitive "Bearer", one or more spaces, and a token that is
// "bct_" followed by the canonical base64url encoding of 32 bytes.
var wellFormed = regexp.MustCompile(`^[Bb][Ee][Aa][Rr][Ee][Rr] +(bct_[A-Za-z0-9_-]{43})$`)

// FuzzParseBearer checks that ParseBearer never panics and accepts exactly
// the well-formed headers, returning their token. Run it with
// `go test -run '^$' -fuzz FuzzParseBearer -fuzztime 30s ./iam`; crashers
// found land in testdata/fuzz/FuzzParseBearer and run with every `go test`.
func FuzzParseBearer(f *testing.F) {
	for _, seed := range []string{
		"", "Bearer", "Bearer ", "Bearer " + goodToken, "bearer  " + goodToken, "Basic " + goodToken,
		"Bearer bct_", "Bearer bct_unknown", "Bearer " + goodToken + "=", "Bearer " + goodToken[:46] + "9",
		"Bearer bcjt_" + goodToken[4:], "Bearer\t" + goodToken, "Bearer " + goodToken[:20] + "\r\n" + goodToken[20:],
		"BEARER " + strings.ToLower(goodToken), "Bearer " + strings.Repeat("_", 47),
	} {
		f.Add(seed)
	}
	f.Fuzz(func(t *testing.T, header string) {
		secret, err := iam.ParseBearer(header)
		m := wellFormed.FindStringSubmatch(header)
		canonical := false
		if m != nil {
			b, derr := base64.RawURLEncoding.DecodeString(m[1][len("bct_"):])
			canonical = derr == nil && len(b) == 32 && base64.RawURLEncoding.EncodeToString(b) == m[1][len("bct_"):]
		}
		if !canonical {
			if err == nil {
				t.Fatalf("accepted malformed header %q as %q", header, secret)
			}
			if secret != "" {
				t.Fatalf("refused header %q but returned %q", header, secret)
			}
			require.ErrorIs(t, err, iam.ErrUnauthenticated)
			return
		}
		if err != nil {
			t.Fatalf("refused well-formed header %q: %v", header, err)
		}
		if secret != m[1] {
			t.Fatalf("header %q gave token %q, want %q", header, secret, m[1])
		}
	})
}
