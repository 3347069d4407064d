//go:build !unix

package agent

// lockDir does nothing where flock is unavailable.
func lockDir(string) (func(), error) { return func() {}, nil }
