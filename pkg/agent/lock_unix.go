//go:build unix

package agent

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// lockDir takes the exclusive lock (flock) of a machine directory itself, so
// that two processes never drive the same identity, and without creating a
// file; release it with the returned function. It fails when another
// process holds it.
func lockDir(dir string) (func(), error) {
	f, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("%s is in use by another agent process (give each its own --data-dir)", dir)
		}
		return nil, err
	}
	return func() {
		_ = syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}, nil
}
