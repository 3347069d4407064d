package daemon_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/types/known/durationpb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
)

// welcomeAcking answers Hello with a Welcome of gatewayID; the test
// answers the heartbeats itself (ackHeartbeats), or lets the gateway go
// silent.
func (h *harness) welcomeAcking(gatewayID string, hb time.Duration) {
	h.receive(&gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_Welcome{Welcome: &gatewayv1.Welcome{
		SessionId: "ses_" + gatewayID, GatewayId: gatewayID, HeartbeatInterval: durationpb.New(hb), SessionEpoch: 1,
	}}})
}

// ackHeartbeats answers every heartbeat sent since the last call, as a live
// gateway does, and returns how many it answered.
func (h *harness) ackHeartbeats() int {
	n := 0
	for _, m := range h.take() {
		if hb := m.GetHeartbeat(); hb != nil {
			h.receive(&gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_HeartbeatAck{HeartbeatAck: &gatewayv1.HeartbeatAck{Seq: hb.GetSeq()}}})
			n++
		}
	}
	return n
}

// establishAcking starts (if idle), connects and welcomes from a gateway
// whose heartbeat acknowledgements the test sends itself (ackHeartbeats).
func (h *harness) establishAcking(gatewayID string, hb time.Duration) {
	h.manualAcks = true
	if h.a.Status().State == daemon.StateIdle {
		h.apply(h.a.Start(h.now))
	}
	require.Equal(h.t, daemon.StateDialing, h.a.Status().State)
	h.connect()
	h.take()
	h.welcomeAcking(gatewayID, hb)
	require.Equal(h.t, daemon.StateEstablished, h.a.Status().State)
	require.Equal(h.t, gatewayID, h.a.Status().GatewayID)
}

// TestSilentGatewayIsDroppedAndReplaced: a gateway that acknowledges
// heartbeats keeps the session as long as it answers; once it stops
// answering (hung, paused) without the connection ending, the Agent drops
// the session hard (EffectClose with Abort) when it heard nothing for the
// silence timeout (3 × 10 s, capped at 15 s) and dials a new session, on
// which it is established again. Nothing but the Agent's own clock notices:
// no Disconnected ever comes for the frozen session.
func TestSilentGatewayIsDroppedAndReplaced(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establishAcking("gw-a", 10*time.Second)

	// A live gateway: each heartbeat answered for ten minutes.
	for range 60 {
		h.advance(10 * time.Second)
		require.Equal(t, 1, h.ackHeartbeats())
	}
	require.Empty(t, h.closed)
	require.Equal(t, daemon.StateEstablished, h.a.Status().State)

	// The gateway freezes: heartbeats go out, nothing comes back.
	frozenAt := h.now
	session := h.session
	h.advance(14 * time.Second)
	require.Equal(t, daemon.StateEstablished, h.a.Status().State, "still within the silence timeout")
	require.Empty(t, h.closed)
	h.advance(time.Second)
	require.Len(t, h.closed, 1, "the silent session is closed: %v", h.log)
	c := h.closed[0]
	require.Equal(t, session, c.Session)
	require.True(t, c.Abort, "closed hard: the driver must not wait on the frozen gateway")
	require.Contains(t, c.Reason, "gateway silent for 15s")
	require.Equal(t, frozenAt.Add(daemon.DefaultSilenceCap), h.now)
	st := h.a.Status()
	require.Equal(t, daemon.StateBackoff, st.State)
	require.Equal(t, 1, st.Silenced)
	require.Empty(t, st.GatewayID)
	// The session lasted long enough for the backoff to start over: the
	// next dial comes within BackoffMin (250 ms).
	require.LessOrEqual(t, st.NextDial.Sub(h.now), 250*time.Millisecond)

	// Stale news of the frozen session changes nothing.
	require.Nil(t, h.a.Receive(h.now, session, &gatewayv1.SessionResponse{Msg: &gatewayv1.SessionResponse_HeartbeatAck{HeartbeatAck: &gatewayv1.HeartbeatAck{Seq: 1}}}))
	h.advance(st.NextDial.Sub(h.now))
	require.Equal(t, session+1, h.session, "a new session is dialed")
	h.establishAcking("gw-b", 10*time.Second)
	for range 6 {
		h.advance(10 * time.Second)
		require.Equal(t, 1, h.ackHeartbeats())
	}
	require.Len(t, h.closed, 1)
	require.Equal(t, "gw-b", h.a.Status().GatewayID)
}

// TestAnyGatewayMessageCountsAsHeard: commands and desired states show the
// gateway alive as acknowledgements do.
func TestAnyGatewayMessageCountsAsHeard(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{}, 1)
	h.establishAcking("gw-a", 10*time.Second)
	h.advance(14 * time.Second)
	h.receive(desired(1, nil))
	h.advance(14 * time.Second)
	h.receive(cmd("cmd_1", "inventory.refresh", time.Time{}, true))
	h.advance(14 * time.Second)
	require.Empty(t, h.closed)
	h.advance(time.Second)
	require.Len(t, h.closed, 1)
	require.True(t, h.closed[0].Abort)
}

// TestConfiguredSilenceTimeout: a configured silence timeout is used as
// given when it exceeds 1.5 heartbeat intervals.
func TestConfiguredSilenceTimeout(t *testing.T) {
	t.Parallel()
	h := newHarness(t, daemon.Config{SilenceTimeout: 4 * time.Second}, 1)
	h.establishAcking("gw-a", 2*time.Second)
	h.advance(2 * time.Second)
	require.Equal(t, 1, h.ackHeartbeats())
	answered := h.now
	h.advance(3900 * time.Millisecond)
	require.Empty(t, h.closed)
	h.advance(100 * time.Millisecond)
	require.Len(t, h.closed, 1)
	require.Equal(t, answered.Add(4*time.Second), h.now)
	require.Contains(t, h.closed[0].Reason, "gateway silent for 4s")
}

func TestSilenceTimeoutDefaults(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		configured, hb, want time.Duration
	}{
		{0, 10 * time.Second, 15 * time.Second},                // 3·hb capped at 15 s
		{0, 2 * time.Second, 6 * time.Second},                  // 3·hb
		{0, 20 * time.Second, 30 * time.Second},                // never below 1.5·hb
		{5 * time.Second, 10 * time.Second, 15 * time.Second},  // a configured value too
		{12 * time.Second, 5 * time.Second, 12 * time.Second},  // as configured
		{40 * time.Second, 10 * time.Second, 40 * time.Second}, // as configured
	} {
		require.Equal(t, tc.want, daemon.SilenceTimeout(tc.configured, tc.hb), "configured %s, heartbeat %s", tc.configured, tc.hb)
	}
}
