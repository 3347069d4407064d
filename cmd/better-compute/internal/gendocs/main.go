// Command gendocs writes the CLI reference, docs/cli.md, from the cobra tree
// of better-compute (`make generate`; `make generate-check` fails when the
// file differs from what this writes). Every command's section is cobra's
// Markdown of its help: usage, long description, flags, inherited flags,
// and links to its parent and subcommands as anchors in the same file.
//
// Usage: go run ./cmd/better-compute/internal/gendocs PATH
package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"

	"github.com/better-compute/better-compute/cmd/better-compute/internal/cli"
	"github.com/better-compute/better-compute/pkg/clock"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: gendocs PATH")
		os.Exit(2)
	}
	if err := write(os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "gendocs:", err)
		os.Exit(1)
	}
}

func write(path string) error {
	// The help text must not depend on this machine's environment.
	env := cli.Env{Stdout: io.Discard, Stderr: io.Discard, Getenv: func(string) string { return "" }, Clock: clock.New()}
	root := cli.NewRoot(env)
	var b bytes.Buffer
	b.WriteString("# CLI reference\n\n")
	b.WriteString("Generated from the commands' help by `make generate` (cmd/better-compute/internal/gendocs); do not edit.\n")
	b.WriteString("`better-compute <command> --help` prints the same.\n\n")
	var walk func(c *cobra.Command) error
	walk = func(c *cobra.Command) error {
		if !c.IsAvailableCommand() && c != root {
			return nil
		}
		c.DisableAutoGenTag = true
		if err := doc.GenMarkdownCustom(c, &b, anchor); err != nil {
			return err
		}
		b.WriteString("\n")
		for _, sub := range c.Commands() {
			if err := walk(sub); err != nil {
				return err
			}
		}
		return nil
	}
	if err := walk(root); err != nil {
		return err
	}
	out := strings.TrimRight(b.String(), "\n") + "\n"
	return os.WriteFile(path, []byte(out), 0o644)
}

// anchor turns cobra's link to another command's file ("better-compute_nodes_list.md")
// into a link to its section in this file.
func anchor(name string) string {
	base := strings.TrimSuffix(name, ".md")
	return "#" + strings.ReplaceAll(base, "_", "-")
}
