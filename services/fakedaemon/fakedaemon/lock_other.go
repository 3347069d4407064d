//go:build !unix

package fakedaemon

// lockDir does nothing where flock is unavailable.
func lockDir(string) (func(), error) { return func() {}, nil }
