//go:build race

package gateway_test

// idleStackBytes is the stack of an idle session's goroutine once the
// runtime shrank it. The race detector doubles what the runtime counts for
// its own calls (1,600 bytes instead of 800), so it keeps 8 KiB for a
// goroutine that waits about 1 KiB deep, as an idle framed session does
// (waitFramed).
const idleStackBytes = 8 << 10
