package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	"unicode"

	"github.com/spf13/cobra"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
)

// Output formats of -o.
const (
	formatTable = "table"
	formatJSON  = "json"
)

// addOutputFlag adds -o/--output to c and returns where its value lands.
func addOutputFlag(c *cobra.Command) *string {
	var f string
	c.Flags().StringVarP(&f, "output", "o", formatTable, "output format: table or json")
	_ = c.RegisterFlagCompletionFunc("output", completeValues(formatTable, formatJSON))
	return &f
}

func checkFormat(f string) error {
	if f != formatTable && f != formatJSON {
		return fmt.Errorf("-o: unknown output format %q (want table or json)", f)
	}
	return nil
}

// writeJSON writes v as indented JSON.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// cell returns s fit for one table cell, or any line the CLI prints of
// text it did not write itself (reasons, hostnames, error messages):
// control characters (newlines, tabs, terminal escapes: text written by
// other callers or machines, such as audit details) are shown escaped, as in
// a Go string literal, so they cannot break the output or drive the
// terminal.
func cell(s string) string {
	if !strings.ContainsFunc(s, unicode.IsControl) {
		return s
	}
	q := strconv.Quote(s)
	return q[1 : len(q)-1]
}

// table writes rows under a header, columns aligned with spaces.
func table(w io.Writer, header []string, rows [][]string) error {
	var buf bytes.Buffer
	tw := tabwriter.NewWriter(&buf, 0, 0, 3, ' ', 0)
	fmt.Fprintln(tw, strings.Join(header, "\t"))
	for _, r := range rows {
		cells := make([]string, len(r))
		for i, c := range r {
			cells[i] = cell(c)
		}
		fmt.Fprintln(tw, strings.Join(cells, "\t"))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	// Empty last cells leave padding behind; drop it.
	var out strings.Builder
	for line := range strings.Lines(buf.String()) {
		out.WriteString(strings.TrimRight(line, " \n"))
		out.WriteByte('\n')
	}
	_, err := io.WriteString(w, out.String())
	return err
}

// ago renders how long before now t was: "3s ago", "5m ago", "2h ago",
// "4d ago"; "never" for nil.
func ago(now time.Time, t *time.Time) string {
	if t == nil {
		return "never"
	}
	d := max(now.Sub(*t), 0)
	switch {
	case d < time.Minute:
		return fmt.Sprintf("%ds ago", int(d/time.Second))
	case d < time.Hour:
		return fmt.Sprintf("%dm ago", int(d/time.Minute))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh ago", int(d/time.Hour))
	default:
		return fmt.Sprintf("%dd ago", int(d/(24*time.Hour)))
	}
}

// orDash returns s, or "-" when it is empty.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// writeProto writes m as indented protojson.
func writeProto(w io.Writer, m proto.Message) error {
	b, err := protojson.Marshal(m)
	if err != nil {
		return err
	}
	// Re-indent: protojson's own spacing is deliberately unstable.
	var buf bytes.Buffer
	if err := json.Indent(&buf, b, "", "  "); err != nil {
		return err
	}
	buf.WriteByte('\n')
	_, err = w.Write(buf.Bytes())
	return err
}

// idJSONCmd returns a command that takes one id, calls do with the API
// clients and prints what do returns as JSON: a proto.Message in its
// protojson form (writeProto), anything else with encoding/json (writeJSON).
func (a *app) idJSONCmd(use, short string, do func(ctx context.Context, cl *apiClients, id string) (any, error)) *cobra.Command {
	return &cobra.Command{
		Use:   use,
		Short: short,
		Args:  exactArgs(strings.Fields(use)[1]),
		RunE: func(cmd *cobra.Command, args []string) error {
			cl, err := a.clients()
			if err != nil {
				return err
			}
			v, err := do(cmd.Context(), cl, args[0])
			if err != nil {
				return err
			}
			if m, ok := v.(proto.Message); ok {
				return writeProto(a.env.Stdout, m)
			}
			return writeJSON(a.env.Stdout, v)
		},
	}
}
