package devstack

import (
	"os"
	"path/filepath"
	"syscall"
)

// throwawayPrefix names the throwaway DataDirs in os.TempDir().
const throwawayPrefix = "bc-devstack-"

// throwawayLock is the file whose flock marks a throwaway DataDir in use.
const throwawayLock = ".lock"

// makeThrowaway makes a throwaway DataDir and locks it for as long as the
// returned file stays open (closing it unlocks), after removing the
// throwaway DataDirs of stacks that ended without Close (a killed process).
func makeThrowaway() (string, *os.File, error) {
	sweepThrowaways()
	dir, err := os.MkdirTemp("", throwawayPrefix)
	if err != nil {
		return "", nil, err
	}
	// Locked under another name first, so a sweeper never finds the lock
	// file free.
	lock, err := os.OpenFile(filepath.Join(dir, throwawayLock+".new"), os.O_CREATE|os.O_RDWR, 0o600)
	if err == nil {
		err = syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	}
	if err == nil {
		err = os.Rename(lock.Name(), filepath.Join(dir, throwawayLock))
	}
	if err != nil {
		if lock != nil {
			lock.Close()
		}
		_ = os.RemoveAll(dir)
		return "", nil, err
	}
	return dir, lock, nil
}

// sweepThrowaways removes the throwaway DataDirs whose lock nobody holds.
// A directory without a lock file is left alone: its stack may be between
// making it and locking it.
func sweepThrowaways() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), throwawayPrefix+"*"))
	for _, dir := range dirs {
		f, err := os.OpenFile(filepath.Join(dir, throwawayLock), os.O_RDWR, 0)
		if err != nil {
			continue
		}
		// Held (EWOULDBLOCK): a running stack's. Any other error: leave it.
		if syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB) == nil {
			_ = os.RemoveAll(dir)
		}
		f.Close()
	}
}
