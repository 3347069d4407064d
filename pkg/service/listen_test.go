package service

import (
	"context"
	"net"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestListenPicksTheLocalAddress: a name resolving to every replica's
// address (a compose network alias of a scaled service) listens on the one
// that is this machine's, whatever its place in the answer; with none of
// them local it fails naming the host.
func TestListenPicksTheLocalAddress(t *testing.T) {
	probe, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := strconv.Itoa(probe.Addr().(*net.TCPAddr).Port)
	require.NoError(t, probe.Close())

	lookup := func(ips ...string) func(context.Context, string) ([]string, error) {
		return func(context.Context, string) ([]string, error) { return ips, nil }
	}
	// 198.51.100.1 (TEST-NET-2) and 203.0.113.1 (TEST-NET-3) are no addresses of this machine.
	ln, err := listen("joinservice-control:"+port, lookup("198.51.100.1", "127.0.0.1"))
	require.NoError(t, err)
	require.Equal(t, "127.0.0.1:"+port, ln.Addr().String())
	require.NoError(t, ln.Close())

	_, err = listen("joinservice-control:"+port, lookup("198.51.100.1", "203.0.113.1"))
	require.ErrorContains(t, err, "none of the addresses of joinservice-control is this machine's")
}
