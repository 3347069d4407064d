package pgembed

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/better-compute/better-compute/pkg/clock"
)

// lockName is the lock file of a Memory server's temporary directory.
const lockName = "better-compute.lock"

// holderName is the file in a persistent cluster directory that holds the
// pid of the supervisor that has the directory locked; it is written after
// initdb, which needs an empty directory.
const holderName = "better-compute.pid"

// lockDir takes the exclusive lock of the persistent cluster directory dir
// for this process: an flock on the directory itself, so that it can be taken
// before initdb, which needs the directory empty. The descriptor is
// close-on-exec: postgres does not inherit the lock. It returns an error
// wrapping ErrInUse when another supervisor holds the lock.
func lockDir(dir string) (*os.File, error) {
	f, err := os.OpenFile(dir, os.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("data directory %s: %w", dir, err)
	}
	if err := flock(f); err != nil {
		_ = f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, &dirError{msg: fmt.Sprintf("data directory %s is in use by another process (%s)", dir, holder(filepath.Join(dir, holderName))), kind: ErrInUse}
		}
		return nil, fmt.Errorf("data directory %s: cannot lock it: %w", dir, err)
	}
	return f, nil
}

// writeHolderPid writes this process's pid into dir's holder file.
func writeHolderPid(dir string, ru *runUser) error {
	path := filepath.Join(dir, holderName)
	if err := os.WriteFile(path, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o600); err != nil {
		return fmt.Errorf("data directory %s is not writable: %w", dir, err)
	}
	return ru.chown(path)
}

// lockNew locks the new directory dir. The lock file is created, locked and
// filled under a temporary name and only then renamed into place, so that
// sweepMemoryDirs never sees an unlocked lock file of a live supervisor.
func lockNew(dir string) (*os.File, error) {
	tmp := filepath.Join(dir, lockName+".new")
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("directory %s is not writable: %w", dir, err)
	}
	if err = flock(f); err == nil {
		if err = writePid(f); err == nil {
			err = os.Rename(tmp, filepath.Join(dir, lockName))
		}
	}
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("directory %s: cannot create its lock file: %w", dir, err)
	}
	return f, nil
}

func flock(f *os.File) error {
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if !errors.Is(err, syscall.EINTR) {
			return err
		}
	}
}

func writePid(f *os.File) error {
	if err := f.Truncate(0); err != nil {
		return err
	}
	_, err := f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return err
}

// holder describes the process whose pid the lock file at path holds.
func holder(path string) string {
	b, err := os.ReadFile(path)
	if err == nil {
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			return "pid " + strconv.Itoa(pid)
		}
	}
	return "pid unknown"
}

// sweepMemoryDirs removes the Memory directories in base that supervisors
// killed before their Stop left behind: those whose lock file nobody holds.
// Orphaned postgres processes in them are stopped first. Errors are logged,
// not returned: sweeping is housekeeping.
func sweepMemoryDirs(ctx context.Context, clk clock.Clock, base string, log *slog.Logger) {
	entries, err := os.ReadDir(base)
	if err != nil {
		return
	}
	for _, e := range entries {
		if !e.IsDir() || !strings.HasPrefix(e.Name(), memPrefix) {
			continue
		}
		dir := filepath.Join(base, e.Name())
		f, err := os.OpenFile(filepath.Join(dir, lockName), os.O_RDWR|syscall.O_CLOEXEC, 0)
		if err != nil {
			continue // no lock file: not ours, or still being created
		}
		if flock(f) != nil {
			_ = f.Close() // held: a live supervisor's
			continue
		}
		log.Info("removing the in-memory cluster of a killed supervisor", "dir", dir)
		if err := clearStale(ctx, clk, filepath.Join(dir, memDataName), log); err != nil && !errors.Is(err, os.ErrNotExist) {
			log.Warn("cannot clear a stale in-memory cluster", "dir", dir, "err", err)
		} else if err := os.RemoveAll(dir); err != nil {
			log.Warn("cannot remove a stale in-memory cluster", "dir", dir, "err", err)
		}
		_ = f.Close()
	}
}
