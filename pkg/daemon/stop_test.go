package daemon_test

import (
	"bytes"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/daemon"
)

// logTo returns a logger writing text records into b.
func logTo(b *bytes.Buffer) *slog.Logger {
	return slog.New(slog.NewTextHandler(b, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// requireStoppedForGood checks that the Agent stopped for good with a reason
// containing want, told the driver once (EffectStop), logged it as an error,
// and never dials again however long it waits.
func requireStoppedForGood(t *testing.T, h *harness, logs *bytes.Buffer, want string) {
	t.Helper()
	st := h.a.Status()
	require.Equal(t, daemon.StateStopped, st.State)
	require.ErrorContains(t, st.Stopped, want)
	require.Len(t, h.stops, 1)
	require.Contains(t, h.stops[0].Reason, want)
	require.Contains(t, logs.String(), "level=ERROR")
	require.Contains(t, logs.String(), want)
	require.True(t, h.timer.IsZero(), "no timer: nothing left to do")
	session := h.session
	h.advance(24 * time.Hour)
	h.apply(h.a.Tick(h.now))
	require.Equal(t, session, h.session, "never dials again")
	require.Nil(t, h.a.Start(h.now), "a stopped Agent does not start again")
	require.Equal(t, daemon.StateStopped, h.a.Status().State)
}

// TestRevokedSessionStopsForGood: a session the gateway refuses or ends
// because the node (or its certificate) is revoked is terminal: the Agent
// stops instead of reconnecting forever, whether it was established or
// still saying Hello.
func TestRevokedSessionStopsForGood(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		reach func(h *harness)
	}{
		{"closed while established", func(h *harness) { h.establish() }},
		{"refused before Welcome", func(h *harness) {
			h.apply(h.a.Start(h.now))
			h.connect()
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var logs bytes.Buffer
			h := newHarness(t, daemon.Config{Logger: logTo(&logs)}, 1)
			tc.reach(h)
			revoked := fmt.Errorf("unauthenticated: certificate revoked: %w", daemon.ErrRevoked)
			h.apply(h.a.Disconnected(h.now, h.session, revoked))
			requireStoppedForGood(t, h, &logs, "node node_1 was revoked")
			require.ErrorIs(t, h.a.Status().Stopped, daemon.ErrRevoked)
			require.Contains(t, logs.String(), "must join again")
		})
	}
}

// TestOtherSessionErrorsStillReconnect: only a revocation is terminal.
func TestOtherSessionErrorsStillReconnect(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establish()
	h.apply(h.a.Disconnected(h.now, h.session, fmt.Errorf("unauthenticated: certificate does not match")))
	require.Equal(t, daemon.StateBackoff, h.a.Status().State)
	require.Empty(t, h.stops)
	h.redial()
}

// TestExpiredCertificateStopsBeforeDialling: a certificate whose NotAfter
// has passed is never presented (the handshake would fail forever with
// "tls: expired certificate"): at start, or when it expired while the node
// was offline, the Agent stops for good instead of dialling.
func TestExpiredCertificateStopsBeforeDialling(t *testing.T) {
	t.Parallel()
	t.Run("expired at start", func(t *testing.T) {
		var logs bytes.Buffer
		h := newHarness(t, daemon.Config{Logger: logTo(&logs),
			CertNotBefore: t0.Add(-25 * time.Hour), CertNotAfter: t0.Add(-time.Hour)}, 1)
		h.apply(h.a.Start(h.now))
		require.Zero(t, h.session, "never dialled")
		requireStoppedForGood(t, h, &logs, "node certificate expired at "+t0.Add(-time.Hour).UTC().Format(time.RFC3339)+"; join again")
		require.ErrorIs(t, h.a.Status().Stopped, daemon.ErrCertificateExpired)
	})
	t.Run("expired while offline", func(t *testing.T) {
		var logs bytes.Buffer
		h := newHarness(t, daemon.Config{Logger: logTo(&logs), BackoffMin: time.Hour, BackoffMax: time.Hour,
			CertNotBefore: t0.Add(-23 * time.Hour), CertNotAfter: t0.Add(time.Minute)}, 1)
		h.establish()
		dialled := h.session
		h.disconnect()
		// The next dial comes after NotAfter (the backoff is up to an hour;
		// seed 1 draws more than a minute).
		require.True(t, h.a.Status().NextDial.After(t0.Add(time.Minute)), "test needs a dial after NotAfter")
		h.advance(h.a.Status().NextDial.Sub(h.now))
		require.Equal(t, dialled, h.session, "no dial with an expired certificate")
		requireStoppedForGood(t, h, &logs, "node certificate expired at")
	})
}

// TestRevokedOldCertificateReconnectsWithRenewed: when the certificate the
// session was opened with is revoked after the Agent renewed it, the
// refusal is not terminal: the next dial presents the renewed certificate.
// A refusal of that dial too is.
func TestRevokedOldCertificateReconnectsWithRenewed(t *testing.T) {
	t.Parallel()
	f := newCertFixture(t)
	var logs bytes.Buffer
	h := newHarness(t, daemon.Config{Logger: logTo(&logs), CertNotBefore: t0, CertNotAfter: t0.Add(24 * time.Hour)}, 1)
	h.establish()
	h.advance(16 * time.Hour)
	require.Equal(t, 1, h.csrs)
	csr := f.csr()
	h.apply(h.a.RenewalCSR(h.now, csr, nil))
	msg, _ := f.issue(csr, h.now, 24*time.Hour)
	h.receive(msg)
	require.Len(t, h.certs, 1)

	revoked := fmt.Errorf("unauthenticated: certificate revoked: %w", daemon.ErrRevoked)
	h.apply(h.a.Disconnected(h.now, h.session, revoked))
	require.Equal(t, daemon.StateBackoff, h.a.Status().State, "the renewed certificate may still be good")
	require.Empty(t, h.stops)
	require.Equal(t, daemon.StateDialing, func() daemon.State {
		h.advance(h.a.Status().NextDial.Sub(h.now))
		return h.a.Status().State
	}())
	h.apply(h.a.Disconnected(h.now, h.session, revoked))
	requireStoppedForGood(t, h, &logs, "was revoked")
}
