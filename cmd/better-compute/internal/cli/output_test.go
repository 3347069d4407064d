package cli

import (
	"strings"
	"testing"
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
