package cli

import (
	"errors"
	"strings"
	"testing"

	"connectrpc.com/connect"
)

// TestTableEscapesControlCharacters checks that text from other callers
// cannot break a table's rows or reach the terminal as escapes.
func TestTableEscapesControlCharacters(t *testing.T) {
	var b strings.Builder
	if err := table(&b, []string{"NAME", "DETAIL"}, [][]string{{"a\nb", "\x1b[31mRED\x1b[0m"}, {"plain é", "x\ty"}}); err != nil {
		t.Fatal(err)
	}
	got := b.String()
	if strings.ContainsAny(got, "\x1b\t\r") || strings.Count(got, "\n") != 3 {
		t.Fatalf("table leaked control characters:\n%q", got)
	}
	for _, want := range []string{`a\nb`, `\x1b[31mRED\x1b[0m`, "plain é", `x\ty`} {
		if !strings.Contains(got, want) {
			t.Errorf("table lacks %q:\n%s", want, got)
		}
	}
}

// TestFormatErrorEscapesControlCharacters: an error message from the server
// (which may quote what a machine or another caller sent) reaches the
// terminal escaped.
func TestFormatErrorEscapesControlCharacters(t *testing.T) {
	got := FormatError(connect.NewError(connect.CodeNotFound, errors.New("node \x1b]0;pwned\x07x not found\nfake line")))
	if strings.ContainsAny(got, "\x1b\x07\n") {
		t.Fatalf("FormatError leaked control characters: %q", got)
	}
	if want := `error: not_found: node \x1b]0;pwned\ax not found\nfake line`; got != want {
		t.Fatalf("FormatError = %q, want %q", got, want)
	}
}

// TestAsFlags: a refusal naming a request field names the tunnel command's
// flag instead; other errors pass as they are.
func TestAsFlags(t *testing.T) {
	got := asFlags(connect.NewError(connect.CodeFailedPrecondition, errors.New("reservation_id: reservation res_1 is released, not active")))
	if want := "error: failed_precondition: --reservation: reservation res_1 is released, not active"; FormatError(got) != want {
		t.Fatalf("asFlags: %q, want %q", FormatError(got), want)
	}
	if connect.CodeOf(got) != connect.CodeFailedPrecondition {
		t.Fatalf("asFlags changed the code: %v", got)
	}
	other := connect.NewError(connect.CodeNotFound, errors.New("node node_1 not found"))
	if got := asFlags(other); !errors.Is(got, other) || FormatError(got) != FormatError(other) {
		t.Fatalf("asFlags changed %v", other)
	}
}

// TestFormatErrorKeepsTheCLIsOwnLines: the CLI's own errors (cobra's
// "Did you mean this?") keep their lines and tabs, without a trailing
// newline; a terminal escape in them is still escaped.
func TestFormatErrorKeepsTheCLIsOwnLines(t *testing.T) {
	got := FormatError(errors.New("unknown command \"nod\" for \"better-compute\"\n\nDid you mean this?\n\tnodes\n"))
	if want := "error: unknown command \"nod\" for \"better-compute\"\n\nDid you mean this?\n\tnodes"; got != want {
		t.Fatalf("FormatError = %q, want %q", got, want)
	}
	if got, want := FormatError(errors.New("bad \x1b[2Jname")), `error: bad \x1b[2Jname`; got != want {
		t.Fatalf("FormatError = %q, want %q", got, want)
	}
}

// TestFieldWords: every violation of a refusal that names a field of the
// command names its flag instead, "set <field>" hints say "pass <flag>",
// and the code stays; a refusal naming no field of the command is kept.
func TestFieldWords(t *testing.T) {
	byField := map[string]string{"duration": "--for", "pool_id": "--pool", "reservation_id": "--reservation"}
	in := connect.NewError(connect.CodeInvalidArgument,
		errors.New("pool_id: value length must be at least 1 characters; duration: must be at least 1s; gpus: must be at most 64"))
	got := fieldWords(in, byField)
	if want := "error: invalid_argument: --pool: value length must not be empty; --for: must be at least 1s; gpus: must be at most 64"; FormatError(got) != want {
		t.Fatalf("fieldWords: %q, want %q", FormatError(got), want)
	}
	hint := connect.NewError(connect.CodePermissionDenied, errors.New("role viewer may not (needs x); set reservation_id for the sandbox"))
	if want := "error: permission_denied: role viewer may not (needs x); pass --reservation for the sandbox"; FormatError(fieldWords(hint, byField)) != want {
		t.Fatalf("fieldWords: %q, want %q", FormatError(fieldWords(hint, byField)), want)
	}
	other := connect.NewError(connect.CodeNotFound, errors.New("node node_1 not found"))
	if got := fieldWords(other, byField); !errors.Is(got, other) || FormatError(got) != FormatError(other) {
		t.Fatalf("fieldWords changed %v", other)
	}
	element := connect.NewError(connect.CodeInvalidArgument, errors.New("types[0]: must be short; types[11]: must be long; kinds[0]: x"))
	if want := "error: invalid_argument: --types (entry 1): must be short; --types (entry 12): must be long; kinds[0]: x"; FormatError(fieldWords(element, map[string]string{"types": "--types"})) != want {
		t.Fatalf("fieldWords: %q, want %q", FormatError(fieldWords(element, map[string]string{"types": "--types"})), want)
	}
}

// TestDescribeRules: the API's name pattern reads in words, a list of
// allowed values without its empty one, a length of at least 1 as not
// empty, and durations' bounds in hours and days; the code stays.
func TestDescribeRules(t *testing.T) {
	for _, tc := range []struct{ name, msg, want string }{
		{"pattern", "name: does not match regex pattern `^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`",
			"name: must be lowercase letters, digits and '-', starting and ending with a letter or a digit, at most 63 characters"},
		{"list", "state: must be in list [, pending, binding, active]", "state: must be one of pending, binding or active"},
		{"list of one", "check: must be in list [diag.nvml]", "check: must be diag.nvml"},
		{"list of the empty value", "x: must be in list []", "x: must be in list []"},
		{"not empty", "to: must be at least 1 characters", "to: must not be empty"},
		{"at least 2", "to: must be at least 2 characters", "to: must be at least 2 characters"},
		{"days", "duration: must be greater than or equal to 1s and less than or equal to 31622400s",
			"duration: must be greater than or equal to 1s and less than or equal to 8784h (366d)"},
		{"hours", "ttl: must be greater than 0s and less than or equal to 3600s", "ttl: must be greater than 0s and less than or equal to 1h"},
		{"a day", "timeout: must be less than or equal to 86400s", "timeout: must be less than or equal to 24h"},
		{"minutes", "t: must be greater than 90s and less than 1800s", "t: must be greater than 1m30s and less than 30m"},
		{"mixed", "t: must be less than 5400s", "t: must be less than 1h30m"},
		{"not a bound", "gpus: 64s of them", "gpus: 64s of them"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := FormatError(connect.NewError(connect.CodeInvalidArgument, errors.New(tc.msg)))
			if want := "error: invalid_argument: " + tc.want; got != want {
				t.Fatalf("FormatError: %q, want %q", got, want)
			}
		})
	}
}
