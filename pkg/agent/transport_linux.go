//go:build linux

package agent

import (
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Dead gateways on Linux. A session sends a heartbeat every
// Welcome.heartbeat_interval (10 s); with TCP_USER_TIMEOUT the kernel ends
// the connection (ETIMEDOUT) when one stays unacknowledged for
// unackedTimeout, so a connection that died silently (the gateway's host
// crashed, a partition, a half-open connection) is noticed at most a
// heartbeat interval plus unackedTimeout (25 s) after it died, as fast as
// the 15 s + 10 s HTTP/2 ping did. The acknowledgements come from the
// gateway's kernel: the gateway process is not woken, where a ping every
// 15 s woke it (read the ping, write its answer) 4 times a minute per idle
// machine. A gateway whose kernel answers but whose process does not (paused,
// hung) is noticed by the daemon core instead: it drops a session whose
// gateway, acknowledging heartbeats, was silent for its silence timeout
// (15 s; daemon.Config.SilenceTimeout). The ping stays as a backstop, rarely,
// for that case with an older gateway that does not acknowledge heartbeats.
const (
	unackedTimeout = 15 * time.Second
	pingIdle       = time.Minute
)

// dialControl sets TCP_USER_TIMEOUT (unackedTimeout) on the connection to
// the gateway.
func dialControl(_, _ string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(unackedTimeout.Milliseconds()))
	}); err != nil {
		return err
	}
	return serr
}
