package daemon_test

import (
	"crypto/ed25519"
	"crypto/x509"
	"errors"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
)

// signer is a command-signing root for tests.
type signer struct {
	pub  ed25519.PublicKey
	priv ed25519.PrivateKey
}

func newSigner(t *testing.T) signer {
	t.Helper()
	priv, err := pki.GenerateSigningKey()
	require.NoError(t, err)
	return signer{pub: priv.Public().(ed25519.PublicKey), priv: priv}
}

func encodeUnsigned(t *testing.T, m proto.Message) []byte {
	t.Helper()
	m = proto.Clone(m)
	switch x := m.(type) {
	case *gatewayv1.Command:
		x.Signature = nil
	case *gatewayv1.DesiredState:
		x.Signature = nil
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(m)
	require.NoError(t, err)
	return b
}

// signCommand signs the command of msg for nodeID, in place, and returns msg.
func (s signer) signCommand(t *testing.T, nodeID string, msg *gatewayv1.SessionResponse) *gatewayv1.SessionResponse {
	t.Helper()
	c := msg.GetCommand()
	c.Signature = pki.SignIntent(s.priv, pki.CommandSigningInput(nodeID, encodeUnsigned(t, c)))
	return msg
}

// signSpec signs the desired state of msg for nodeID, in place, and returns
// msg.
func (s signer) signSpec(t *testing.T, nodeID string, msg *gatewayv1.SessionResponse) *gatewayv1.SessionResponse {
	t.Helper()
	ds := msg.GetDesiredState()
	ds.Signature = pki.SignIntent(s.priv, pki.SpecSigningInput(nodeID, encodeUnsigned(t, ds)))
	return msg
}

func TestNewValidatesTrustConfig(t *testing.T) {
	t.Parallel()
	m, err := fakehw.New("cpu", "m")
	require.NoError(t, err)
	r := rand.New(rand.NewPCG(1, 1))
	j := daemon.NewMemoryJournal()
	_, err = daemon.New(daemon.Config{NodeID: "n", CommandSigningRoot: ed25519.PublicKey{1, 2, 3}}, m, j, r)
	require.ErrorContains(t, err, "command-signing root")
	_, err = daemon.New(daemon.Config{NodeID: "n", CertNotAfter: t0}, m, j, r)
	require.ErrorContains(t, err, "NotBefore")
	_, err = daemon.New(daemon.Config{NodeID: "n", CertNotBefore: t0, CertNotAfter: t0}, m, j, r)
	require.ErrorContains(t, err, "NotBefore")
}

// TestSignedIntentCommands: with a command-signing root, only commands
// signed by it for this node run; the others are reported FAILED with the
// reason, never run and never journaled.
func TestSignedIntentCommands(t *testing.T) {
	t.Parallel()
	root, other := newSigner(t), newSigner(t)
	h := newHarness(t, daemon.Config{CommandSigningRoot: root.pub}, 1)
	h.establish()
	deadline := t0.Add(time.Hour)

	tampered := root.signCommand(t, "node_1", cmd("cmd_tampered", "inventory.refresh", deadline, true))
	tampered.GetCommand().ArgsJson = []byte(`{"wipe":true}`)
	retargeted := root.signCommand(t, "node_1", cmd("cmd_retargeted", "inventory.refresh", deadline, true))
	retargeted.GetCommand().RetrySafe = false
	refused := []struct {
		name string
		msg  *gatewayv1.SessionResponse
		want string
	}{
		{"unsigned", cmd("cmd_unsigned", "inventory.refresh", deadline, true), daemon.ErrTextCommandUnsigned},
		{"signed by another key", other.signCommand(t, "node_1", cmd("cmd_other_key", "inventory.refresh", deadline, true)), daemon.ErrTextCommandBadSignature},
		{"signed for another node", root.signCommand(t, "node_2", cmd("cmd_other_node", "inventory.refresh", deadline, true)), daemon.ErrTextCommandBadSignature},
		{"args changed after signing", tampered, daemon.ErrTextCommandBadSignature},
		{"retry_safe changed after signing", retargeted, daemon.ErrTextCommandBadSignature},
		{"garbage signature", func() *gatewayv1.SessionResponse {
			m := cmd("cmd_garbage", "inventory.refresh", deadline, true)
			m.GetCommand().Signature = []byte("not a signature")
			return m
		}(), daemon.ErrTextCommandBadSignature},
	}
	for _, tc := range refused {
		h.receive(tc.msg)
		ups := updates(h.take())
		require.Len(t, ups, 1, tc.name)
		require.Equal(t, failed, ups[0].GetState(), tc.name)
		require.Equal(t, tc.want, ups[0].GetError(), tc.name)
		require.Contains(t, ups[0].GetError(), "refused: ", tc.name)
		require.Contains(t, ups[0].GetError(), "signature", tc.name)
		_, journaled := h.j.Get(tc.msg.GetCommand().GetCommandId())
		require.False(t, journaled, tc.name)
	}
	require.Zero(t, h.hw.runs["inventory.refresh"], "no refused command ran")

	// A correctly signed command runs, even after an unsigned delivery of
	// the same id was refused.
	h.receive(root.signCommand(t, "node_1", cmd("cmd_unsigned", "inventory.refresh", deadline, true)))
	h.advance(time.Minute)
	ups := updates(h.take())
	require.Equal(t, []gatewayv1.CommandState{running, succeeded}, []gatewayv1.CommandState{ups[0].GetState(), ups[len(ups)-1].GetState()})
	require.Equal(t, 1, h.hw.runs["inventory.refresh"])
}

// TestSignedIntentSpecs: with a command-signing root, only desired states
// signed by it for this node are applied; the others are reported as
// SpecRefused and change nothing.
func TestSignedIntentSpecs(t *testing.T) {
	t.Parallel()
	root, other := newSigner(t), newSigner(t)
	h := newHarness(t, daemon.Config{CommandSigningRoot: root.pub}, 1)
	h.establish()
	allocs := map[string][]int32{"res_a": {0, 1}}

	bumped := root.signSpec(t, "node_1", desired(1, allocs, "res_a"))
	bumped.GetDesiredState().Generation = 2
	grown := root.signSpec(t, "node_1", desired(1, allocs, "res_a"))
	grown.GetDesiredState().Spec.Allocations[0].DeviceIndexes = []int32{0, 1, 2, 3}
	refused := []struct {
		name string
		msg  *gatewayv1.SessionResponse
		want string
	}{
		{"unsigned", desired(1, allocs, "res_a"), daemon.ErrTextSpecUnsigned},
		{"signed by another key", other.signSpec(t, "node_1", desired(1, allocs, "res_a")), daemon.ErrTextSpecBadSignature},
		{"signed for another node", root.signSpec(t, "node_2", desired(1, allocs, "res_a")), daemon.ErrTextSpecBadSignature},
		{"generation changed after signing", bumped, daemon.ErrTextSpecBadSignature},
		{"devices changed after signing", grown, daemon.ErrTextSpecBadSignature},
	}
	for _, tc := range refused {
		h.receive(tc.msg)
		sent := h.take()
		require.Len(t, sent, 1, tc.name)
		sr := sent[0].GetReport().GetSpecRefused()
		require.NotNil(t, sr, "%s: %v", tc.name, describe(sent))
		require.Equal(t, tc.msg.GetDesiredState().GetGeneration(), sr.GetGeneration(), tc.name)
		require.Equal(t, tc.want, sr.GetReason(), tc.name)
		require.Zero(t, h.a.Status().ObservedGeneration, tc.name)
		require.Empty(t, h.a.Allocations(), tc.name)
	}

	h.receive(root.signSpec(t, "node_1", desired(1, allocs, "res_a")))
	require.Equal(t, []string{"bound res_a nvidia.com/gpu=0,nvidia.com/gpu=1 gen=1", "observed 1"}, describe(h.take()))
	require.Equal(t, int64(1), h.a.Status().ObservedGeneration)
}

// TestUnsignedIntentWithoutRoot: a node that was given no command-signing
// root runs unsigned commands and applies unsigned specs.
func TestUnsignedIntentWithoutRoot(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establish()
	h.receive(cmd("cmd_1", "inventory.refresh", t0.Add(time.Hour), true))
	h.receive(desired(1, nil))
	h.advance(time.Minute)
	require.Equal(t, 1, h.hw.runs["inventory.refresh"])
	require.Equal(t, int64(1), h.a.Status().ObservedGeneration)
}

// certFixture issues node certificates for renewal tests.
type certFixture struct {
	t  *testing.T
	ca *pki.CA
}

func newCertFixture(t *testing.T) certFixture {
	t.Helper()
	ca, err := pki.NewCA("test node CA", t0.Add(-time.Hour), 10*365*24*time.Hour)
	require.NoError(t, err)
	return certFixture{t: t, ca: ca}
}

// csr returns a CSR of a new key.
func (f certFixture) csr() []byte {
	f.t.Helper()
	key, err := pki.GenerateKey()
	require.NoError(f.t, err)
	der, err := pki.NewCSR(key, "node_1")
	require.NoError(f.t, err)
	return der
}

// issue signs csrDER at now for ttl and returns the CertificateIssued.
func (f certFixture) issue(csrDER []byte, now time.Time, ttl time.Duration) (*gatewayv1.SessionResponse, *x509.Certificate) {
	f.t.Helper()
	csr, err := pki.ParseCSR(csrDER)
	require.NoError(f.t, err)
	cert, err := f.ca.IssueNode(csr, "node_1", "test.local", now, ttl)
	require.NoError(f.t, err)
	return issuedMsg(cert.Raw, ""), cert
}

func issuedMsg(der []byte, errText string) *gatewayv1.SessionResponse {
	return &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_CertificateIssued{CertificateIssued: &gatewayv1.CertificateIssued{
		CertificateDer: der, Error: errText}}}
}

// renewRequests returns the CSRs of the RenewCertificate messages in msgs.
func renewRequests(msgs []*gatewayv1.SessionRequest) [][]byte {
	var out [][]byte
	for _, m := range msgs {
		if r := m.GetRenewCertificate(); r != nil {
			out = append(out, r.GetCsrDer())
		}
	}
	return out
}

// TestRenewalAtTwoThirdsOfLifetime: a 24 h certificate is renewed 16 h
// after its NotBefore, over the established session without closing it; the
// next renewal follows the new certificate's lifetime.
func TestRenewalAtTwoThirdsOfLifetime(t *testing.T) {
	t.Parallel()
	f := newCertFixture(t)
	h := newHarness(t, daemon.Config{CertNotBefore: t0, CertNotAfter: t0.Add(24 * time.Hour)}, 1)
	h.establish()

	h.advance(16*time.Hour - time.Second)
	require.Zero(t, h.csrs, "not renewed before two thirds of the lifetime")
	h.advance(time.Second)
	require.Equal(t, 1, h.csrs, "renewal starts at two thirds of the lifetime")
	require.Equal(t, t0.Add(16*time.Hour), h.now)

	csr := f.csr()
	proof := []byte("the driver's proof")
	h.apply(h.a.RenewalCSR(h.now, csr, proof))
	sent := h.take()
	require.Equal(t, [][]byte{csr}, renewRequests(sent))
	require.Equal(t, proof, sent[len(sent)-1].GetRenewCertificate().GetProof(), "the proof goes with the CSR")

	h.advance(2 * time.Second)
	msg, cert := f.issue(csr, h.now, 24*time.Hour)
	received := h.now
	h.receive(msg)
	require.Len(t, h.certs, 1)
	require.Equal(t, cert.Raw, h.certs[0].Certificate)
	require.True(t, cert.NotAfter.Equal(h.certs[0].NotAfter))
	st := h.a.Status()
	require.Equal(t, daemon.StateEstablished, st.State, "the session goes on")
	require.Equal(t, "ses_1", st.SessionID)
	require.True(t, cert.NotAfter.Equal(st.CertNotAfter))
	require.Equal(t, 1, st.Renewals)
	require.Empty(t, h.closed)

	// The next renewal is at two thirds of the new certificate's lifetime,
	// counted from when it was received (its NotBefore is backdated).
	next := received.Add(cert.NotAfter.Sub(received) * 2 / 3)
	h.advance(next.Sub(h.now) - time.Second)
	require.Equal(t, 1, h.csrs)
	h.advance(time.Second)
	require.Equal(t, 2, h.csrs)

	// A late or repeated answer is ignored.
	h.receive(msg)
	require.Len(t, h.certs, 1)
}

// TestRenewalWaitsForASession: a renewal that comes due while the node has
// no session starts right after the next Welcome.
func TestRenewalWaitsForASession(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{CertNotBefore: t0.Add(-20 * time.Hour), CertNotAfter: t0.Add(4 * time.Hour)}, 1)
	h.apply(h.a.Start(h.now))
	h.advance(time.Minute)
	require.Zero(t, h.csrs, "no renewal without an established session")
	h.establish()
	h.advance(0)
	require.Equal(t, 1, h.csrs, "the overdue renewal starts once established")
}

// TestRenewalRetries: a renewal that gets no CSR, no answer, a refusal, a
// certificate for another key, or a driver failure is retried with a
// growing backoff, and a session lost mid-renewal counts as a failure; a
// later success resets the backoff.
func TestRenewalRetries(t *testing.T) {
	t.Parallel()
	f := newCertFixture(t)
	cfg := daemon.Config{CertNotBefore: t0.Add(-20 * time.Hour), CertNotAfter: t0.Add(4 * time.Hour),
		RenewTimeout: 10 * time.Second, RenewBackoffMin: 4 * time.Second, RenewBackoffMax: time.Minute}
	h := newHarness(t, cfg, 1)
	h.establish()
	h.advance(0)
	require.Equal(t, 1, h.csrs)

	// waitRetry checks that the next EffectMakeCSR comes within [cap/2,
	// cap] after the failure at failedAt.
	waitRetry := func(failedAt time.Time, capDelay time.Duration, what string) {
		t.Helper()
		before := h.csrs
		h.advance(capDelay/2 - time.Millisecond - h.now.Sub(failedAt))
		require.Equal(t, before, h.csrs, "%s: no retry before half the backoff", what)
		for h.csrs == before {
			require.False(t, h.timer.IsZero(), what)
			require.False(t, h.timer.After(failedAt.Add(capDelay)), "%s: retried within the backoff", what)
			h.advance(h.timer.Sub(h.now))
		}
		require.Equal(t, before+1, h.csrs, what)
	}

	// 1. The driver makes no CSR: failed after RenewTimeout.
	h.advance(10*time.Second - time.Millisecond)
	require.Equal(t, 1, h.csrs)
	h.advance(time.Millisecond)
	waitRetry(h.now, 4*time.Second, "no CSR")

	// 2. The gateway does not answer.
	h.apply(h.a.RenewalCSR(h.now, f.csr(), nil))
	require.Len(t, renewRequests(h.take()), 1)
	h.advance(10 * time.Second)
	waitRetry(h.now, 8*time.Second, "no answer")

	// 3. The gateway refuses.
	h.apply(h.a.RenewalCSR(h.now, f.csr(), nil))
	h.take()
	h.receive(issuedMsg(nil, "certificate revoked"))
	waitRetry(h.now, 16*time.Second, "refused")

	// 4. A certificate for another key.
	h.apply(h.a.RenewalCSR(h.now, f.csr(), nil))
	h.take()
	wrong, _ := f.issue(f.csr(), h.now, 24*time.Hour)
	h.receive(wrong)
	require.Empty(t, h.certs, "a certificate for another key is not used")
	waitRetry(h.now, 32*time.Second, "another key")

	// 5. The driver cannot make a CSR.
	h.apply(h.a.RenewalFailed(h.now, errors.New("disk full")))
	waitRetry(h.now, time.Minute, "driver failed")

	// 6. The session ends mid-renewal: the Welcome of the next one counts
	// the failure (capped backoff) and the renewal is retried.
	h.apply(h.a.RenewalCSR(h.now, f.csr(), nil))
	h.take()
	h.disconnect()
	h.redial()
	waitRetry(h.now, time.Minute, "session lost")
	require.Empty(t, h.certs)

	// Success resets the backoff: the next failure waits min again.
	csr := f.csr()
	h.apply(h.a.RenewalCSR(h.now, csr, nil))
	require.Len(t, renewRequests(h.take()), 1)
	msg, _ := f.issue(csr, h.now, 24*time.Hour)
	h.receive(msg)
	require.Len(t, h.certs, 1)
	h.apply(h.a.RenewalFailed(h.now, errors.New("could not write node.json")))
	waitRetry(h.now, 4*time.Second, "after a success")
}

// TestShortCertificateRenewsNoFasterThanBackoffMin: a certificate whose
// renewal point has already passed when it is issued is not renewed again
// before RenewBackoffMin.
func TestShortCertificateRenewsNoFasterThanBackoffMin(t *testing.T) {
	t.Parallel()
	f := newCertFixture(t)
	h := newHarness(t, daemon.Config{CertNotBefore: t0.Add(-time.Hour), CertNotAfter: t0.Add(time.Minute),
		RenewBackoffMin: 5 * time.Second}, 1)
	h.establish()
	h.advance(0)
	require.Equal(t, 1, h.csrs)
	csr := f.csr()
	h.apply(h.a.RenewalCSR(h.now, csr, nil))
	// Two thirds of this certificate's remaining lifetime are 4 s.
	msg, _ := f.issue(csr, h.now, 6*time.Second)
	h.receive(msg)
	require.Len(t, h.certs, 1)
	h.advance(5*time.Second - time.Millisecond)
	require.Equal(t, 1, h.csrs)
	h.advance(time.Millisecond)
	require.Equal(t, 2, h.csrs)
}

// TestCertificateIssuedWithoutRenewalIsIgnored: an unsolicited
// CertificateIssued changes nothing.
func TestCertificateIssuedWithoutRenewalIsIgnored(t *testing.T) {
	t.Parallel()
	f := newCertFixture(t)
	h := newHarness(t, daemon.Config{CertNotBefore: t0, CertNotAfter: t0.Add(24 * time.Hour)}, 1)
	h.establish()
	msg, _ := f.issue(f.csr(), h.now, 24*time.Hour)
	h.receive(msg)
	require.Empty(t, h.certs)
	require.True(t, t0.Add(24*time.Hour).Equal(h.a.Status().CertNotAfter))
}

// TestShortCertificateRenewedOnceAtTwoThirds: with a 90 s TTL, a node
// renews about every 60 s, not every RenewBackoffMin: the renewal point of a
// certificate counts from when it was received (or its NotBefore, if later),
// so a backdated NotBefore never puts it in the past.
func TestShortCertificateRenewedOnceAtTwoThirds(t *testing.T) {
	t.Parallel()
	f := newCertFixture(t)
	key, err := pki.GenerateKey()
	require.NoError(t, err)
	csrDER, err := pki.NewCSR(key, "node_1")
	require.NoError(t, err)
	_, first := f.issue(csrDER, t0, 90*time.Second)
	h := newHarness(t, daemon.Config{CertNotBefore: first.NotBefore, CertNotAfter: first.NotAfter, CertReceivedAt: t0,
		RenewBackoffMin: 5 * time.Second}, 1)
	h.establish()
	for i := range 3 {
		issuedAt := h.now
		h.advance(60*time.Second - time.Millisecond)
		require.Equal(t, i, h.csrs, "renewal %d not before 60 s", i+1)
		h.advance(time.Millisecond)
		require.Equal(t, i+1, h.csrs, "renewal %d at 60 s", i+1)
		require.Equal(t, issuedAt.Add(60*time.Second), h.now)
		csr := f.csr()
		h.apply(h.a.RenewalCSR(h.now, csr, nil))
		msg, _ := f.issue(csr, h.now, 90*time.Second)
		h.receive(msg)
		require.Len(t, h.certs, i+1)
	}
	require.Equal(t, 3, h.a.Status().Renewals, "three renewals in three minutes, not one every 5 s")
}
