//go:build !race

package gateway_test

// idleStackBytes is the stack of an idle session's goroutine once the
// runtime shrank it: it halves a stack of which less than a quarter is
// used, counting 800 bytes for its own calls, and an idle framed session
// waits at about 1 KiB deep (waitFramed).
const idleStackBytes = 4 << 10
