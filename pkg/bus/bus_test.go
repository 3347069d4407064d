package bus_test

import (
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/bus"
	"github.com/better-compute/better-compute/pkg/bus/bustest"
	"github.com/better-compute/better-compute/pkg/telemetry"
)

// TestPublishWithID: a message published with an id names it in the header,
// in decimal; one with id 0 has no header.
func TestPublishWithID(t *testing.T) {
	t.Parallel()
	srv, err := bustest.StartEmbedded(t.TempDir())
	require.NoError(t, err)
	t.Cleanup(srv.Shutdown)
	nc, err := bus.Connect(srv.ClientURL(), "test", telemetry.Discard())
	require.NoError(t, err)
	t.Cleanup(nc.Close)
	sub, err := nc.SubscribeSync("t.>")
	require.NoError(t, err)
	publish := bus.PublishWithID(nc, "Bc-Row")
	require.NoError(t, publish("t.a", []byte("a"), 42))
	require.NoError(t, publish("t.b", []byte("b"), 0))
	next := func() *nats.Msg {
		m, err := sub.NextMsg(10 * time.Second)
		require.NoError(t, err)
		return m
	}
	m := next()
	require.Equal(t, "t.a", m.Subject)
	require.Equal(t, "a", string(m.Data))
	require.Equal(t, "42", m.Header.Get("Bc-Row"))
	m = next()
	require.Equal(t, "t.b", m.Subject)
	require.Empty(t, m.Header.Get("Bc-Row"))
}
