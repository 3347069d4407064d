//go:build linux

package agent

import (
	"net"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// TestDialSetsUserTimeout checks that connections to the gateway end when
// data stays unacknowledged for unackedTimeout: the kernel, not an HTTP/2
// ping, notices a gateway that died silently.
func TestDialSetsUserTimeout(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	c, err := (&net.Dialer{Control: dialControl}).DialContext(t.Context(), "tcp", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	raw, err := c.(syscall.Conn).SyscallConn()
	require.NoError(t, err)
	var got int
	var gerr error
	require.NoError(t, raw.Control(func(fd uintptr) {
		got, gerr = unix.GetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT)
	}))
	require.NoError(t, gerr)
	require.Equal(t, int(unackedTimeout.Milliseconds()), got)
}
