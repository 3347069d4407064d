//go:build !linux

package agent

import (
	"syscall"
	"time"
)

// Dead gateways elsewhere than on Linux (no TCP_USER_TIMEOUT): the HTTP/2
// ping notices a connection that died silently, pingIdle without a frame
// plus the ping's 10 s timeout (25 s) after it died.
const pingIdle = 15 * time.Second

// dialControl is nil: no socket option.
var dialControl func(network, address string, c syscall.RawConn) error
