package cli

import (
	"fmt"
	"strings"

	"github.com/spf13/cobra"
)

// exactArgs is cobra.ExactArgs(len(names)) with errors that name what is
// missing or extra: "missing NODE_ID (usage: better-compute nodes get
// NODE_ID)" when fewer arguments than names are given, "unexpected argument
// "x" (usage: …)" when more are. names are the placeholders of the command's
// Use line, in order.
func exactArgs(names ...string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		usage := "usage: " + cmd.UseLine()
		if len(args) < len(names) {
			return fmt.Errorf("missing %s (%s)", strings.Join(names[len(args):], " and "), usage)
		}
		if len(args) > len(names) {
			extra := make([]string, len(args)-len(names))
			for i, a := range args[len(names):] {
				extra[i] = fmt.Sprintf("%q", a)
			}
			word := "argument"
			if len(extra) > 1 {
				word = "arguments"
			}
			return fmt.Errorf("unexpected %s %s (%s)", word, strings.Join(extra, " "), usage)
		}
		return nil
	}
}
