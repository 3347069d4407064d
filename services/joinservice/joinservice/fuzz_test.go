package joinservice

import (
	"crypto/ecdh"
	"errors"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/pki"
)

// FuzzJoinRequest feeds arbitrary bytes, decoded as a JoinRequest, through
// every check JoinService runs before the database (decodeJoinRequest):
// it must never panic, must answer garbage with a Connect error of the
// documented codes, and may accept only a request whose token opens.
func FuzzJoinRequest(f *testing.F) {
	key, err := pki.GenerateJoinEncryptionKey()
	if err != nil {
		f.Fatal(err)
	}
	nodeKey, err := pki.GenerateKey()
	if err != nil {
		f.Fatal(err)
	}
	csr, err := pki.NewCSR(nodeKey, "machine")
	if err != nil {
		f.Fatal(err)
	}
	token, err := iam.NewSecret(iam.JoinTokenPrefix)
	if err != nil {
		f.Fatal(err)
	}
	sealed, err := pki.SealJoinToken(key.PublicKey(), token, csr)
	if err != nil {
		f.Fatal(err)
	}
	for _, seed := range []*joinv1.JoinRequest{
		{SealedToken: sealed, CsrDer: csr, Claims: &joinv1.Claims{Hostname: "gpu-01", MachineId: "m-01", AgentVersion: "bcd/1.0"}},
		{SealedToken: sealed, CsrDer: csr},
		{SealedToken: sealed[:49], CsrDer: csr},
		{CsrDer: csr},
	} {
		b, err := proto.Marshal(seed)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	// The valid seed is accepted: the target can tell good from bad.
	in, err := decodeJoinRequest(key, &joinv1.JoinRequest{SealedToken: sealed, CsrDer: csr})
	if err != nil || string(in.tokenHash) != string(iam.HashSecret(token)) {
		f.Fatalf("the valid seed was refused: %v", err)
	}

	f.Fuzz(func(t *testing.T, b []byte) {
		var req joinv1.JoinRequest
		if err := proto.Unmarshal(b, &req); err != nil {
			return // Connect answers undecodable bodies itself
		}
		in, err := decodeJoinRequest(key, &req)
		if err != nil {
			var cerr *connect.Error
			if !errors.As(err, &cerr) {
				t.Fatalf("not a Connect error: %T %v", err, err)
			}
			switch cerr.Code() {
			case connect.CodeInvalidArgument, connect.CodeUnauthenticated:
			default:
				t.Fatalf("unexpected code %v: %v", cerr.Code(), err)
			}
			return
		}
		if in.csr == nil || len(in.tokenHash) == 0 {
			t.Fatalf("accepted without a CSR or token: %+v", in)
		}
		if _, err := pki.OpenJoinToken(key, req.GetSealedToken(), req.GetCsrDer()); err != nil {
			t.Fatalf("accepted a token that does not open: %v", err)
		}
	})
}

// TestDecodeRefusesMalformedSealedToken: a sealed token that opens but
// holds no well-formed join token ("bcjt_" and the base64url of 32 bytes,
// as iam.NewSecret makes it) is refused as an unknown token is, before
// the database is asked.
func TestDecodeRefusesMalformedSealedToken(t *testing.T) {
	t.Parallel()
	key, err := pki.GenerateJoinEncryptionKey()
	if err != nil {
		t.Fatal(err)
	}
	nodeKey, err := pki.GenerateKey()
	if err != nil {
		t.Fatal(err)
	}
	csr, err := pki.NewCSR(nodeKey, "machine")
	if err != nil {
		t.Fatal(err)
	}
	good, err := iam.NewSecret(iam.JoinTokenPrefix)
	if err != nil {
		t.Fatal(err)
	}
	api, err := iam.NewSecret(iam.APITokenPrefix)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, token string }{
		{"api token", api},
		{"no prefix", strings.TrimPrefix(good, iam.JoinTokenPrefix)},
		{"short", good[:len(good)-1]},
		{"long", good + "A"},
		{"not base64url", good[:len(good)-1] + "\x00"},
		{"huge", iam.JoinTokenPrefix + strings.Repeat("A", 3000)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sealed, err := pki.SealJoinToken(key.PublicKey(), tc.token, csr)
			if err != nil {
				t.Fatal(err)
			}
			_, err = decodeJoinRequest(key, &joinv1.JoinRequest{SealedToken: sealed, CsrDer: csr})
			if connect.CodeOf(err) != connect.CodeUnauthenticated || !strings.Contains(err.Error(), "join token is not valid") {
				t.Fatalf("decodeJoinRequest = %v, want Unauthenticated: join token is not valid", err)
			}
		})
	}
	in, err := decodeJoinRequest(key, &joinv1.JoinRequest{SealedToken: mustSeal(t, key, good, csr), CsrDer: csr})
	if err != nil || string(in.tokenHash) != string(iam.HashSecret(good)) {
		t.Fatalf("a well-formed token was refused: %v", err)
	}
}

func mustSeal(t *testing.T, key *ecdh.PrivateKey, token string, csr []byte) []byte {
	t.Helper()
	sealed, err := pki.SealJoinToken(key.PublicKey(), token, csr)
	if err != nil {
		t.Fatal(err)
	}
	return sealed
}
