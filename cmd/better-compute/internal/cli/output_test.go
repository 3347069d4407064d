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
