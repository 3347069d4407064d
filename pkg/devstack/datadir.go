package devstack

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Files of a kept DataDir besides the Dir* and File* names.
const (
	// fileLock is flocked by the stack that uses the directory; it holds
	// that process's pid.
	fileLock = ".lock"
	// fileMarker marks a directory as a dev stack's DataDir.
	fileMarker = ".better-compute-dev"
)

// ErrDataDirInUse is wrapped by Start's error when another stack (in this or
// another process) uses Options.DataDir.
var ErrDataDirInUse = errors.New("the data directory is in use by another stack")

// ErrNotDataDir is wrapped by Start's error when Options.DataDir is not a
// directory, or holds files and is not a stack's DataDir.
var ErrNotDataDir = errors.New("not a dev stack's data directory")

// DataDirError is Start's error about Options.DataDir; its message names
// the directory and says what is wrong with it.
type DataDirError struct {
	Dir string
	Msg string
	Err error // ErrDataDirInUse, ErrNotDataDir or the cause
}

func (e *DataDirError) Error() string { return "data directory " + e.Dir + " " + e.Msg }

func (e *DataDirError) Unwrap() error { return e.Err }

// dataDir is a locked DataDir.
type dataDir struct {
	path string
	lock *os.File
	// created is the topmost directory Start made for it ("" when it
	// existed): a failed Start removes it.
	created string
	// marked reports that this Start made an existing empty directory a
	// DataDir: a failed Start empties it again.
	marked bool
}

// openDataDir makes dir (mode 0700, and its missing parents) unless it
// exists, locks it, and checks that it is empty or a stack's DataDir. It
// never removes anything: a directory whose lock another stack holds may
// have been made by this call and be that stack's now.
func openDataDir(dir string) (*dataDir, error) {
	d := &dataDir{path: dir}
	fail := func(msg string, err error) (*dataDir, error) {
		if d.lock != nil {
			d.lock.Close()
		}
		return nil, &DataDirError{Dir: dir, Msg: msg, Err: err}
	}
	switch fi, err := os.Stat(dir); {
	case errors.Is(err, os.ErrNotExist):
		if _, lerr := os.Lstat(dir); lerr == nil {
			return fail("is a symbolic link to nothing", ErrNotDataDir)
		}
		top := dir
		for p := filepath.Dir(dir); p != filepath.Dir(p); p = filepath.Dir(p) {
			if _, err := os.Lstat(p); err == nil {
				break
			}
			top = p
		}
		if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
			return fail("cannot be created: "+errText(err), err)
		}
		if err := os.Mkdir(dir, 0o700); err == nil {
			d.created = top
		} else if !errors.Is(err, os.ErrExist) { // made by another stack meanwhile: fine
			return fail("cannot be created: "+errText(err), err)
		}
	case err != nil:
		return fail("cannot be read: "+errText(err), err)
	case !fi.IsDir():
		return fail("is not a directory", ErrNotDataDir)
	}
	lockPath := filepath.Join(dir, fileLock)
	lock, err := os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_CLOEXEC, 0o600)
	madeLock := err == nil
	if errors.Is(err, os.ErrExist) {
		lock, err = os.OpenFile(lockPath, os.O_RDWR|syscall.O_CLOEXEC, 0)
	}
	if err != nil {
		return fail("is not writable: "+errText(err), err)
	}
	d.lock = lock
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		holder := "pid unknown"
		if b, err := os.ReadFile(lock.Name()); err == nil {
			if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
				holder = "pid " + strconv.Itoa(pid)
			}
		}
		return fail("is in use by another better-compute dev stack ("+holder+")", ErrDataDirInUse)
	}
	// The pid only names the holder in the message above: best effort.
	_ = lock.Truncate(0)
	_, _ = lock.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return fail("cannot be read: "+errText(err), err)
	}
	if _, err := os.Stat(filepath.Join(dir, fileMarker)); err != nil {
		for _, e := range entries {
			if e.Name() != fileLock {
				if madeLock {
					_ = os.Remove(lockPath) // leave the directory as it was
				}
				return fail("holds files that are not a better-compute dev stack's (use an empty or new directory)", ErrNotDataDir)
			}
		}
		if err := os.WriteFile(filepath.Join(dir, fileMarker), []byte("a better-compute dev stack's data directory\n"), 0o600); err != nil {
			return fail("is not writable: "+errText(err), err)
		}
		d.marked = true
	}
	return d, nil
}

// errText is err's message without the path that DataDirError names.
func errText(err error) string {
	var pe *os.PathError
	if errors.As(err, &pe) {
		return pe.Err.Error()
	}
	return err.Error()
}

// close unlocks the directory. With failedStart it first removes what this
// Start made: the directory (and parents) it created, or everything in an
// empty directory it made a DataDir.
func (d *dataDir) close(failedStart bool) {
	switch {
	case !failedStart:
	case d.created != "":
		_ = os.RemoveAll(d.created)
	case d.marked:
		entries, _ := os.ReadDir(d.path)
		for _, e := range entries {
			if e.Name() != fileLock {
				_ = os.RemoveAll(filepath.Join(d.path, e.Name()))
			}
		}
		_ = os.Remove(d.lock.Name()) // still locked: no other stack took it meanwhile
	}
	d.lock.Close()
}

// state is what a kept DataDir remembers between runs (FileState).
type state struct {
	// Instance names this DataDir's stack in lease holders and gateway ids,
	// so two stacks on one database never take each other's.
	Instance string `json:"instance"`
	// Gateways and Join are the listeners' ports, so machines that joined
	// find the gateways again.
	Gateways []int `json:"gateways,omitempty"`
	Join     int   `json:"join,omitempty"`
}

// readState reads the DataDir's state; a missing or damaged file gives a
// new instance name and no ports.
func readState(dir string) state {
	var st state
	if b, err := os.ReadFile(filepath.Join(dir, FileState)); err == nil {
		_ = json.Unmarshal(b, &st) // damaged: new ports, new name
	}
	if st.Instance == "" {
		var raw [4]byte
		_, _ = rand.Read(raw[:])
		st.Instance = hex.EncodeToString(raw[:])
	}
	return st
}

// writeState writes st to the DataDir.
func writeState(dir string, st state) error {
	b, err := json.Marshal(st)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, FileState), append(b, '\n'), 0o600)
}

// throwawayPrefix names the throwaway DataDirs in os.TempDir().
const throwawayPrefix = "bc-devstack-"

// makeThrowaway makes a throwaway DataDir and locks it for as long as the
// returned file stays open.
func makeThrowaway() (string, *os.File, error) {
	dir, err := os.MkdirTemp("", throwawayPrefix)
	if err != nil {
		return "", nil, err
	}
	// Locked under another name first, so a sweeper never finds the lock
	// file free.
	lock, err := os.OpenFile(filepath.Join(dir, fileLock+".new"), os.O_CREATE|os.O_RDWR|syscall.O_CLOEXEC, 0o600)
	if err == nil {
		err = syscall.Flock(int(lock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	}
	if err == nil {
		err = os.Rename(lock.Name(), filepath.Join(dir, fileLock))
	}
	if err != nil {
		if lock != nil {
			lock.Close()
		}
		_ = os.RemoveAll(dir)
		return "", nil, fmt.Errorf("devstack: throwaway directory: %w", err)
	}
	return dir, lock, nil
}

// sweepThrowaways removes the throwaway DataDirs of stacks that ended
// without Close (a killed process): those whose lock nobody holds. A
// directory without a lock file is left alone: its stack may be between
// making it and locking it.
func sweepThrowaways() {
	dirs, _ := filepath.Glob(filepath.Join(os.TempDir(), throwawayPrefix+"*"))
	for _, dir := range dirs {
		f, err := os.OpenFile(filepath.Join(dir, fileLock), os.O_RDWR|syscall.O_CLOEXEC, 0)
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
