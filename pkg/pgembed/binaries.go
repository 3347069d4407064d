package pgembed

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
)

// envBinDir is the environment variable FindBinDir consults first: a
// directory that holds the PostgreSQL server binaries initdb and postgres.
const envBinDir = "BETTER_COMPUTE_POSTGRES_BIN"

// installHint is the one command that installs the server binaries.
const installHint = `install them with "apt-get install postgresql" (Debian/Ubuntu) or set ` + envBinDir + ` to their directory`

// serverBinaries are the programs a bin directory must hold.
var serverBinaries = []string{"initdb", "postgres"}

// FindBinDir returns the directory of the PostgreSQL server binaries (initdb
// and postgres). It looks, in order, at the directory named by the
// BETTER_COMPUTE_POSTGRES_BIN variable (read through getenv; when set, it is
// the only candidate), at the output of "pg_config --bindir" when pg_config is
// on getenv("PATH") and that directory holds both binaries (on Debian
// /usr/bin/pg_config may be a client-only wrapper), and at
// /usr/lib/postgresql/*/bin, preferring the highest major version. It returns
// an error that names what is missing and the command that installs it.
func FindBinDir(getenv func(string) string) (string, error) {
	if dir := getenv(envBinDir); dir != "" {
		if missing := missingBinaries(dir); len(missing) > 0 {
			return "", fmt.Errorf("%s=%s does not hold the PostgreSQL server binaries (%s missing): %s",
				envBinDir, dir, strings.Join(missing, ", "), installHint)
		}
		return filepath.Clean(dir), nil
	}
	if pgConfig := lookPath("pg_config", getenv("PATH")); pgConfig != "" {
		out, err := exec.Command(pgConfig, "--bindir").Output()
		if dir := strings.TrimSpace(string(out)); err == nil && dir != "" && len(missingBinaries(dir)) == 0 {
			return filepath.Clean(dir), nil
		}
	}
	if dir := newestDebianBinDir(); dir != "" {
		return dir, nil
	}
	return "", fmt.Errorf("PostgreSQL server binaries not found (%s): %s", strings.Join(serverBinaries, ", "), installHint)
}

// checkBinDir returns an error when dir lacks one of the server binaries.
func checkBinDir(dir string) error {
	if missing := missingBinaries(dir); len(missing) > 0 {
		return fmt.Errorf("PostgreSQL server binaries not found in %s (%s missing): %s",
			dir, strings.Join(missing, ", "), installHint)
	}
	return nil
}

// missingBinaries lists the server binaries that dir lacks (all of them when
// dir does not exist).
func missingBinaries(dir string) []string {
	var missing []string
	for _, name := range serverBinaries {
		if !isExecutable(filepath.Join(dir, name)) {
			missing = append(missing, name)
		}
	}
	return missing
}

func isExecutable(path string) bool {
	fi, err := os.Stat(path)
	return err == nil && fi.Mode().IsRegular() && fi.Mode().Perm()&0o111 != 0
}

// lookPath finds name in the PATH-style list path, like exec.LookPath but on
// the given value instead of the process environment.
func lookPath(name, path string) string {
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		if p := filepath.Join(dir, name); isExecutable(p) {
			return p
		}
	}
	return ""
}

// newestDebianBinDir returns the /usr/lib/postgresql/<major>/bin directory of
// the highest major version that holds the server binaries, or "".
func newestDebianBinDir() string {
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	best, bestVersion := "", [2]int{-1, -1}
	for _, dir := range dirs {
		v, ok := parseMajor(filepath.Base(filepath.Dir(dir)))
		if !ok || len(missingBinaries(dir)) > 0 {
			continue
		}
		if v[0] > bestVersion[0] || (v[0] == bestVersion[0] && v[1] > bestVersion[1]) {
			best, bestVersion = dir, v
		}
	}
	return best
}

// parseMajor parses a PostgreSQL major version: "15" or, before 10, "9.6".
func parseMajor(s string) ([2]int, bool) {
	first, rest, dotted := strings.Cut(s, ".")
	a, err := strconv.Atoi(first)
	if err != nil {
		return [2]int{}, false
	}
	b := 0
	if dotted {
		if b, err = strconv.Atoi(rest); err != nil {
			return [2]int{}, false
		}
	}
	return [2]int{a, b}, true
}

var versionRE = regexp.MustCompile(`\(PostgreSQL\) (\d+)(?:\.(\d+))?`)

// serverMajor runs "postgres --version" in binDir and returns the major
// version as PG_VERSION spells it ("15", or "9.6" before PostgreSQL 10).
func serverMajor(binDir string) (string, error) {
	postgres := filepath.Join(binDir, "postgres")
	var out bytes.Buffer
	cmd := exec.Command(postgres, "--version")
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("%s --version failed: %w: %s", postgres, err, oneLine(out.String()))
	}
	m := versionRE.FindStringSubmatch(out.String())
	if m == nil {
		return "", fmt.Errorf("%s --version printed %q, which names no PostgreSQL version", postgres, oneLine(out.String()))
	}
	if major, _ := strconv.Atoi(m[1]); major < 10 && m[2] != "" {
		return m[1] + "." + m[2], nil
	}
	return m[1], nil
}

// oneLine joins the non-empty lines of s with " | ".
func oneLine(s string) string {
	var parts []string
	for line := range strings.SplitSeq(s, "\n") {
		if line = strings.TrimSpace(line); line != "" {
			parts = append(parts, line)
		}
	}
	return strings.Join(parts, " | ")
}
