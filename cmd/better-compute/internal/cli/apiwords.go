package cli

import (
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
)

// API errors name the request's fields ("duration: must be at least 1s",
// protovalidate's and the handlers' alike: service.ViolationsText); the CLI
// shows them in the words of the command that was run, naming its flags
// and arguments (--for, POOL_ID; "types[1]" is "--types (entry 2)"), and
// says protovalidate's rules in its own terms: regular expressions in
// words, the allowed values of a list without the empty one (which is
// leaving the flag out), durations in hours and days rather than seconds.

// ruleWords describes, in words, the patterns of the API's proto rules
// (api/proto/bc/compute/v1/compute.proto) that refusals quote: protovalidate
// says "does not match regex pattern `<pattern>`".
var ruleWords = map[string]string{
	// Names of tenants, sites and pools: min_len 1, max_len 63.
	`^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`: "must be lowercase letters, digits and '-', starting and ending with a letter or a digit, at most 63 characters",
	// Regions, request ids.
	`^[^\p{Cc}\p{Cf}\p{Zl}\p{Zp}]*$`: "must not contain control, format or line-separator characters",
	// Reasons (cordon, revoke).
	`^[^\p{Cc}\x{202A}-\x{202E}\x{2066}-\x{2069}\p{Zl}\p{Zp}]*$`: "must not contain control characters, bidirectional overrides or line separators",
	// Event type patterns.
	`^[a-z_]+(\.[a-z_]+)*(\.\*)?$`: "must be an event type such as node.cordoned or a family such as node.*",
}

// describeRules is msg with protovalidate's wording of its rules in the
// CLI's: each quoted pattern of ruleWords in words, "must be in list [,
// a, b]" as "must be one of a or b" (the empty value is a flag left out),
// "must be at least 1 characters" as "must not be empty", and the bounds
// of a duration, which protovalidate gives in seconds ("less than or equal
// to 31622400s"), as the CLI writes durations (humanSeconds: "8784h
// (366d)").
func describeRules(msg string) string {
	if strings.Contains(msg, "regex pattern `") {
		for pattern, words := range ruleWords {
			msg = strings.ReplaceAll(msg, "does not match regex pattern `"+pattern+"`", words)
		}
	}
	msg = inList.ReplaceAllStringFunc(msg, func(m string) string {
		var values []string
		for v := range strings.SplitSeq(inList.FindStringSubmatch(m)[1], ", ") {
			if v != "" {
				values = append(values, v)
			}
		}
		switch len(values) {
		case 0:
			return m
		case 1:
			return "must be " + values[0]
		}
		return "must be one of " + strings.Join(values[:len(values)-1], ", ") + " or " + values[len(values)-1]
	})
	msg = strings.ReplaceAll(msg, "must be at least 1 characters", "must not be empty")
	return durationBound.ReplaceAllStringFunc(msg, func(m string) string {
		sub := durationBound.FindStringSubmatch(m)
		n, err := strconv.ParseInt(sub[2], 10, 64)
		if err != nil {
			return m
		}
		return sub[1] + " " + humanSeconds(n)
	})
}

var (
	// inList is protovalidate's refusal of a string outside its "in" rule.
	inList = regexp.MustCompile(`must be in list \[([^\]]*)\]`)
	// durationBound is a bound of protovalidate's duration rules: "than
	// 0s", "equal to 86400s".
	durationBound = regexp.MustCompile(`\b(than|to) (\d+)s\b`)
)

// humanSeconds writes n seconds as the CLI's flags take durations: whole
// hours as hours, with days beside them from two days on ("24h", "8784h
// (366d)"), anything else as a Go duration without trailing zero units
// ("90s" is "1m30s", "1800s" is "30m").
func humanSeconds(n int64) string {
	const hour, day = 3600, 24 * 3600
	switch {
	case n >= 2*day && n%day == 0:
		return fmt.Sprintf("%dh (%dd)", n/hour, n/day)
	case n >= hour && n%hour == 0:
		return fmt.Sprintf("%dh", n/hour)
	case n >= int64(maxLifetime/time.Second):
		return strconv.FormatInt(n, 10) + "s"
	}
	d := (time.Duration(n) * time.Second).String()
	if strings.HasSuffix(d, "m0s") {
		d = strings.TrimSuffix(d, "0s")
	}
	if strings.HasSuffix(d, "h0m") {
		d = strings.TrimSuffix(d, "0m")
	}
	return d
}

// elementPath is protovalidate's path of an element of a repeated field
// ("types[1]").
var elementPath = regexp.MustCompile(`^([a-z_]+)\[(\d+)\]$`)

// fields records the flags and arguments of c by the request field they set
// ("duration": "--for"), for the errors of its API calls (inFlagWords).
func (a *app) fields(c *cobra.Command, byField map[string]string) *cobra.Command {
	if a.fieldsOf == nil {
		a.fieldsOf = map[*cobra.Command]map[string]string{}
	}
	a.fieldsOf[c] = byField
	return c
}

// inFlagWords is err with its Connect message in the words of c's flags
// (fieldWords), when c recorded its fields; other errors pass unchanged.
func (a *app) inFlagWords(c *cobra.Command, err error) error {
	if c == nil || a.fieldsOf[c] == nil {
		return err
	}
	return fieldWords(err, a.fieldsOf[c])
}

// fieldWords is err with a Connect message whose violations ("field:
// reason", joined by "; ") start with a field of byField starting with its
// flag instead ("duration: …" → "--for: …"; an element of a repeated
// field, "types[1]: …", → "--types (entry 2): …"), and whose hints "set
// <field>" and "(<field>)" say "pass <flag>" and "(<flag>)"; the code and
// details are kept. Other errors pass as they are.
func fieldWords(err error, byField map[string]string) error {
	var cerr *connect.Error
	if !errors.As(err, &cerr) {
		return err
	}
	msg := cerr.Message()
	parts := strings.Split(msg, "; ")
	for i, p := range parts {
		field, rest, ok := strings.Cut(p, ": ")
		if !ok {
			continue
		}
		if flag, known := byField[field]; known {
			parts[i] = flag + ": " + rest
			continue
		}
		if m := elementPath.FindStringSubmatch(field); m != nil {
			n, err := strconv.Atoi(m[2])
			if flag, known := byField[m[1]]; known && err == nil {
				parts[i] = fmt.Sprintf("%s (entry %d): %s", flag, n+1, rest)
			}
		}
	}
	out := strings.Join(parts, "; ")
	for field, flag := range byField {
		out = strings.ReplaceAll(out, "set "+field+" ", "pass "+flag+" ")
		out = strings.ReplaceAll(out, "("+field+")", "("+flag+")")
	}
	if out == msg {
		return err
	}
	n := connect.NewError(cerr.Code(), errors.New(out))
	for _, d := range cerr.Details() {
		n.AddDetail(d)
	}
	return n
}
