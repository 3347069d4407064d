package pgembed

import (
	"bufio"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
)

// Capability numbers (linux/capability.h).
const (
	capDACOverride   = 1
	capDACReadSearch = 2
)

// runUser is the identity initdb and postgres run as.
type runUser struct {
	name   string
	uid    uint32
	gid    uint32
	groups []uint32
	// switchTo is set when this process is root, so children get uid/gid
	// through SysProcAttr.Credential and files are chowned to them.
	switchTo bool
}

// resolveRunAs picks the server's user. As root it is name, or "postgres"
// when that user exists, or "nobody"; otherwise it is this process's user,
// and name must be empty or name that user.
func resolveRunAs(name string) (*runUser, error) {
	if os.Geteuid() != 0 {
		ru := &runUser{uid: uint32(os.Geteuid()), gid: uint32(os.Getegid())}
		if u, err := user.LookupId(strconv.Itoa(os.Geteuid())); err == nil {
			ru.name = u.Username
		} else {
			ru.name = "uid " + strconv.Itoa(os.Geteuid())
		}
		if name != "" && name != ru.name && name != strconv.Itoa(os.Geteuid()) {
			return nil, fmt.Errorf("pgembed: Options.RunAs=%q needs root, but this process runs as %s", name, ru.name)
		}
		if gs, err := os.Getgroups(); err == nil {
			for _, g := range gs {
				ru.groups = append(ru.groups, uint32(g))
			}
		}
		return ru, nil
	}
	if name == "" {
		name = "nobody"
		if _, err := user.Lookup("postgres"); err == nil {
			name = "postgres"
		}
	}
	u, err := user.Lookup(name)
	if err != nil {
		return nil, fmt.Errorf("pgembed: Options.RunAs=%q: %w", name, err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err1 != nil || err2 != nil {
		return nil, fmt.Errorf("pgembed: Options.RunAs=%q has a non-numeric uid %q or gid %q", name, u.Uid, u.Gid)
	}
	if uid == 0 {
		return nil, fmt.Errorf("pgembed: Options.RunAs=%q is root, and PostgreSQL refuses to run as root", name)
	}
	ru := &runUser{name: name, uid: uint32(uid), gid: uint32(gid), switchTo: true}
	ids, err := u.GroupIds()
	if err != nil {
		ids = []string{u.Gid}
	}
	for _, id := range ids {
		if g, err := strconv.ParseUint(id, 10, 32); err == nil && !slices.Contains(ru.groups, uint32(g)) {
			ru.groups = append(ru.groups, uint32(g))
		}
	}
	return ru, nil
}

// credential is the SysProcAttr.Credential of a child: nil unless this
// process switches users. The supplementary groups are the user's own, so no
// group of root's leaks into the server.
func (ru *runUser) credential() *syscall.Credential {
	if !ru.switchTo {
		return nil
	}
	return &syscall.Credential{Uid: ru.uid, Gid: ru.gid, Groups: slices.Clone(ru.groups)}
}

// chown gives path to the run user when this process switches users.
func (ru *runUser) chown(path string) error {
	if !ru.switchTo {
		return nil
	}
	if err := os.Lchown(path, int(ru.uid), int(ru.gid)); err != nil {
		return fmt.Errorf("cannot give %s to user %s: %w", path, ru.name, err)
	}
	return nil
}

// canSearch reports whether the run user may traverse the directory fi (owner,
// group and other permission bits; ACLs are not consulted).
func (ru *runUser) canSearch(fi os.FileInfo) bool {
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return true
	}
	switch {
	case st.Uid == ru.uid:
		return st.Mode&0o100 != 0
	case st.Gid == ru.gid || slices.Contains(ru.groups, st.Gid):
		return st.Mode&0o010 != 0
	default:
		return st.Mode&0o001 != 0
	}
}

// blocker returns the first directory on the way to path (from "/" down to
// path's parent, or down to path itself when inclusive) that the run user may
// not search, or "".
func (ru *runUser) blocker(path string, inclusive bool) string {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		real = filepath.Clean(path)
	}
	var dirs []string
	for d := real; ; d = filepath.Dir(d) {
		if d != real || inclusive {
			dirs = append(dirs, d)
		}
		if d == filepath.Dir(d) {
			break
		}
	}
	slices.Reverse(dirs)
	for _, d := range dirs {
		if fi, err := os.Stat(d); err == nil && !ru.canSearch(fi) {
			return d
		}
	}
	return ""
}

// reachPath is a path a child must reach, with what it is for error messages.
type reachPath struct {
	what string // e.g. "data directory"
	path string
}

// ambientCaps returns the ambient capabilities a child running as the run
// user needs to reach every path: none when each ancestor is searchable by the
// user, else CAP_DAC_READ_SEARCH (or CAP_DAC_OVERRIDE when this process lacks
// the former). It fails, naming the blocking directory, when this process has
// neither capability to hand on.
func (ru *runUser) ambientCaps(paths ...reachPath) ([]uintptr, error) {
	return ru.ambientCapsWith(permittedCaps(), paths...)
}

// ambientCapsWith is ambientCaps for the permitted capability set permitted.
func (ru *runUser) ambientCapsWith(permitted uint64, paths ...reachPath) ([]uintptr, error) {
	if !ru.switchTo {
		return nil, nil
	}
	var blocked reachPath
	var by string
	for _, p := range paths {
		if by = ru.blocker(p.path, false); by != "" {
			blocked = p
			break
		}
	}
	if by == "" {
		return nil, nil
	}
	switch {
	case permitted&(1<<capDACReadSearch) != 0:
		return []uintptr{capDACReadSearch}, nil
	case permitted&(1<<capDACOverride) != 0:
		return []uintptr{capDACOverride}, nil
	}
	return nil, fmt.Errorf("%s %s cannot be reached by user %s: %s is not searchable by that user (%s), and this process has neither CAP_DAC_READ_SEARCH nor CAP_DAC_OVERRIDE to lend it; use a directory outside %s or make %s searchable (chmod o+x)",
		blocked.what, blocked.path, ru.name, by, describeDir(by), by, by)
}

// checkBinReach fails when the run user cannot execute the binaries in dir
// (capabilities do not help there: the user's effective set is empty when it
// execs).
func (ru *runUser) checkBinReach(dir string) error {
	if !ru.switchTo {
		return nil
	}
	if by := ru.blocker(dir, true); by != "" {
		return fmt.Errorf("PostgreSQL binaries in %s cannot be run by user %s: %s is not searchable by that user (%s)",
			dir, ru.name, by, describeDir(by))
	}
	return nil
}

func describeDir(path string) string {
	fi, err := os.Stat(path)
	if err != nil {
		return err.Error()
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		return fmt.Sprintf("mode %04o, owner uid %d, group gid %d", st.Mode&0o7777, st.Uid, st.Gid)
	}
	return "mode " + fi.Mode().String()
}

// permittedCaps returns this process's permitted capability set (CapPrm in
// /proc/self/status); 0 when it cannot be read.
func permittedCaps() uint64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "CapPrm:"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				return 0
			}
			return n
		}
	}
	return 0
}
