package daemon_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/sshca"
)

func openTunnel(id, purpose string) *gatewayv1.SessionResponse {
	return &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_OpenTunnel{OpenTunnel: &gatewayv1.OpenTunnel{
		TunnelId: id, Purpose: purpose, Size: &tunnelv1.TerminalSize{Rows: 24, Cols: 80},
	}}}
}

// tunnelEffects returns the EffectOpenTunnel effects of effects.
func tunnelEffects(effects []daemon.Effect) []daemon.Effect {
	var out []daemon.Effect
	for _, e := range effects {
		if e.Kind == daemon.EffectOpenTunnel {
			out = append(out, e)
		}
	}
	return out
}

// TestOpenTunnel: an OpenTunnel on the established session becomes
// EffectOpenTunnel for that session; before Welcome, with no id or an
// unknown purpose it is ignored; the Agent's state does not change.
func TestOpenTunnel(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.apply(h.a.Start(h.now))
	h.connect()
	require.Empty(t, tunnelEffects(h.a.Receive(h.now, h.session, openTunnel("tkt_early", "shell"))), "before Welcome")
	h.welcome(10 * time.Second)
	h.take()

	got := tunnelEffects(h.a.Receive(h.now, h.session, openTunnel("tkt_1", "shell")))
	require.Len(t, got, 1)
	require.Equal(t, h.session, got[0].Session)
	require.Equal(t, "tkt_1", got[0].Tunnel.GetTunnelId())
	require.Equal(t, "shell", got[0].Tunnel.GetPurpose())
	require.Equal(t, uint32(24), got[0].Tunnel.GetSize().GetRows())
	require.Equal(t, "open-tunnel[1] tkt_1 shell", got[0].String())
	got = tunnelEffects(h.a.Receive(h.now, h.session, openTunnel("tkt_2", "ssh")))
	require.Len(t, got, 1)
	require.Equal(t, "ssh", got[0].Tunnel.GetPurpose())

	for _, tc := range []struct{ name, id, purpose string }{
		{"no id", "", "shell"},
		{"id too long", "tkt_" + strings.Repeat("x", 61), "shell"},
		{"unknown purpose", "tkt_3", "vnc"},
	} {
		require.Empty(t, tunnelEffects(h.a.Receive(h.now, h.session, openTunnel(tc.id, tc.purpose))), tc.name)
	}
	require.Empty(t, tunnelEffects(h.a.Receive(h.now, h.session+1, openTunnel("tkt_4", "shell"))), "a stale session")
	require.Empty(t, h.take(), "nothing is sent for tunnels")
	require.Equal(t, daemon.StateEstablished, h.a.Status().State)
}

func newUserCA(t *testing.T, name string) *sshca.CA {
	t.Helper()
	_, key, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	ca, err := sshca.NewCA(name, key)
	require.NoError(t, err)
	return ca
}

func withCAs(m *gatewayv1.SessionResponse, cas ...*gatewayv1.SshUserCa) *gatewayv1.SessionResponse {
	m.GetDesiredState().Spec.SshUserCas = cas
	return m
}

// TestSSHAccess: the SSH server's access follows the applied spec (its CAs
// and its reservations), is a new value when it changes and the same one
// when it does not; a spec whose CAs do not parse is refused and leaves no
// CA trusted until a usable one is applied.
func TestSSHAccess(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	start := h.a.SSHAccess()
	require.NotNil(t, start)
	require.Empty(t, start.Authorities)
	require.False(t, start.HasReservation("res_a"))
	h.establish()

	bg, sb := newUserCA(t, sshca.BreakGlass), newUserCA(t, sshca.Sandbox)
	h.receive(withCAs(desired(1, map[string][]int32{"res_b": {1}, "res_a": {0}}, "res_b", "res_a"), bg.UserCA(), sb.UserCA()))
	acc := h.a.SSHAccess()
	require.Equal(t, []string{"res_a", "res_b"}, acc.Reservations)
	require.True(t, acc.HasReservation("res_a"))
	require.False(t, acc.HasReservation("res_c"))
	require.Len(t, acc.Authorities, 2)
	require.Equal(t, sshca.BreakGlass, acc.Authorities[0].Name)
	require.Equal(t, bg.PublicKey(), sshca.MarshalPublicKey(acc.Authorities[0].Key))

	// The same CAs and reservations in a new generation: the same access.
	h.receive(withCAs(desired(2, map[string][]int32{"res_a": {0}, "res_b": {1, 2}}, "res_a", "res_b"), bg.UserCA(), sb.UserCA()))
	require.Same(t, acc, h.a.SSHAccess())
	h.take()

	// res_b leaves the spec.
	h.receive(withCAs(desired(3, map[string][]int32{"res_a": {0}}, "res_a"), bg.UserCA(), sb.UserCA()))
	next := h.a.SSHAccess()
	require.NotSame(t, acc, next)
	require.Equal(t, []string{"res_a"}, next.Reservations)
	require.Equal(t, []string{"res_a", "res_b"}, acc.Reservations, "a returned access never changes")
	h.take()

	// Unusable CAs: refused, not applied, and no CA is trusted any more.
	for _, tc := range []struct {
		name string
		ca   *gatewayv1.SshUserCa
		want string
	}{
		{"a key that does not parse", &gatewayv1.SshUserCa{Name: sshca.BreakGlass, PublicKey: "ssh-ed25519 garbage"}, "ssh user CA break-glass"},
		{"an unknown CA", &gatewayv1.SshUserCa{Name: "root-everywhere", PublicKey: bg.PublicKey()}, `ssh user CA "root-everywhere": unknown name`},
	} {
		h.receive(withCAs(desired(4, map[string][]int32{}), bg.UserCA(), tc.ca))
		sent := h.take()
		require.Len(t, sent, 1, tc.name)
		sr := sent[0].GetReport().GetSpecRefused()
		require.NotNil(t, sr, tc.name)
		require.Equal(t, int64(4), sr.GetGeneration())
		require.True(t, strings.HasPrefix(sr.GetReason(), daemon.ErrTextSpecBadSSHCA+": "), sr.GetReason())
		require.Contains(t, sr.GetReason(), tc.want)
		require.Equal(t, int64(3), h.a.Status().ObservedGeneration, "not applied")
		require.Empty(t, h.a.SSHAccess().Authorities, tc.name)
		require.Equal(t, []string{"res_a"}, h.a.SSHAccess().Reservations, "the applied allocations stay")
	}

	// A usable spec again.
	h.receive(withCAs(desired(4, map[string][]int32{}), bg.UserCA()))
	require.Equal(t, []string{"unbound res_a gen=4", "observed 4"}, describe(h.take()))
	require.Len(t, h.a.SSHAccess().Authorities, 1)
	require.Empty(t, h.a.SSHAccess().Reservations)
}

// TestReportSSHRefused: a refusal goes out on the established session at
// once; without one, the latest MaxPendingSSHRefusals wait for the next
// Welcome.
func TestReportSSHRefused(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establish()
	h.take()
	h.apply(h.a.ReportSSHRefused(&gatewayv1.SshRefused{Reason: "not a certificate", User: "root"}))
	require.Equal(t, []string{`ssh-refused user=root key_id="" reason="not a certificate"`}, describe(h.take()))

	h.disconnect()
	for i := range daemon.MaxPendingSSHRefusals + 2 {
		h.apply(h.a.ReportSSHRefused(&gatewayv1.SshRefused{Reason: "expired", KeyId: string(rune('a' + i)), User: "root"}))
	}
	require.Empty(t, h.take())
	h.redial()
	var keys []string
	for _, m := range h.take() {
		if r := m.GetReport().GetSshRefused(); r != nil {
			keys = append(keys, r.GetKeyId())
		}
	}
	require.Len(t, keys, daemon.MaxPendingSSHRefusals)
	require.Equal(t, "c", keys[0], "the oldest are dropped")
	require.Equal(t, string(rune('a'+daemon.MaxPendingSSHRefusals+1)), keys[len(keys)-1])
}
