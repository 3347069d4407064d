package cli

import (
	"errors"
	"strconv"
	"strings"
	"time"
)

// lifetime is a flag value of a lifetime: a Go duration ("90m", "24h"), a
// number of days with a d suffix, alone or before a Go duration ("7d",
// "1d12h"), or a plain number of seconds ("3600").
type lifetime time.Duration

// errLifetime is the error of a lifetime flag that does not parse; pflag
// prefixes it with the flag and the value.
var errLifetime = errors.New("want a duration such as 90m, 24h or 7d, or a number of seconds")

// String is "" for no lifetime, which pflag takes as no default, so that
// help does not print "(default 0s)" beside a flag's own default text.
func (l *lifetime) String() string {
	if *l == 0 {
		return ""
	}
	return time.Duration(*l).String()
}

func (l *lifetime) Type() string { return "duration" }

func (l *lifetime) Set(s string) error {
	d, err := parseLifetime(s)
	if err != nil {
		return err
	}
	*l = lifetime(d)
	return nil
}

// parseLifetime parses a lifetime (see lifetime).
func parseLifetime(s string) (time.Duration, error) {
	s = strings.TrimSpace(s)
	if n, err := strconv.ParseInt(s, 10, 64); err == nil {
		if n > int64(maxLifetime/time.Second) || n < -int64(maxLifetime/time.Second) {
			return 0, errLifetime
		}
		return time.Duration(n) * time.Second, nil
	}
	var days time.Duration
	if i := strings.IndexByte(s, 'd'); i >= 0 {
		n, err := strconv.ParseUint(s[:i], 10, 32)
		if err != nil || n > uint64(maxLifetime/(24*time.Hour)) {
			return 0, errLifetime
		}
		days, s = time.Duration(n)*24*time.Hour, s[i+1:]
		if s == "" {
			return days, nil
		}
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 && days > 0 {
		return 0, errLifetime
	}
	return days + d, nil
}

// maxLifetime bounds what a lifetime flag parses, far beyond any limit a
// command checks, so that the arithmetic cannot overflow.
const maxLifetime = 100 * 366 * 24 * time.Hour
