package store_test

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/store"
)

// eventConstName is the name of an event type constant: Event, then a
// capital (EventTypes itself is a variable, EventFilter a type).
var eventConstName = regexp.MustCompile(`^Event[A-Z]`)

// TestEventTypesAreTheConstants reads the package's source: every Event*
// string constant is in store.EventTypes, and EventTypes holds nothing else,
// sorted and without duplicates, so that a watch never refuses a pattern
// that matches a type the control plane writes.
func TestEventTypesAreTheConstants(t *testing.T) {
	t.Parallel()
	consts := map[string]string{} // value → name
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		require.NoError(t, err)
		file, err := parser.ParseFile(fset, name, src, 0)
		require.NoError(t, err)
		for _, decl := range file.Decls {
			gd, ok := decl.(*ast.GenDecl)
			if !ok || gd.Tok != token.CONST {
				continue
			}
			for _, spec := range gd.Specs {
				vs := spec.(*ast.ValueSpec)
				for i, id := range vs.Names {
					if !eventConstName.MatchString(id.Name) || i >= len(vs.Values) {
						continue
					}
					lit, ok := vs.Values[i].(*ast.BasicLit)
					require.True(t, ok && lit.Kind == token.STRING, "%s: %s is not a string literal", name, id.Name)
					v, err := strconv.Unquote(lit.Value)
					require.NoError(t, err)
					require.NotContains(t, consts, v, "%s and %s have the same value", consts[v], id.Name)
					consts[v] = id.Name
				}
			}
		}
	}
	require.NotEmpty(t, consts)
	for v, name := range consts {
		require.Contains(t, store.EventTypes, v, "%s (%q) is missing from store.EventTypes", name, v)
	}
	for _, v := range store.EventTypes {
		require.Contains(t, consts, v, "store.EventTypes holds %q, which is no Event* constant", v)
	}
	require.True(t, slices.IsSorted(store.EventTypes), "sorted")
	require.Len(t, store.EventTypes, len(consts), "no duplicates")
	require.Equal(t, []string{"command.*", "node.*", "reservation.*"}, store.EventFamilies())
}

// TestEventPatternKnown checks which type patterns match a type the control
// plane writes.
func TestEventPatternKnown(t *testing.T) {
	t.Parallel()
	for p, want := range map[string]bool{
		"node.*":                 true,
		"reservation.*":          true,
		"command.*":              true,
		"node.cordoned":          true,
		"reservation.active":     true,
		"command.succeeded":      true,
		"bogus":                  false,
		"bogus.*":                false,
		"node":                   false,
		"node.cordon":            false,
		"node.acceptance.*":      false, // node.acceptance_failed is not under node.acceptance.
		"nodes.*":                false,
		"reservation.active.x":   false,
		"reservation.active.*":   false,
		"node.acceptance_failed": true,
		"":                       false,
	} {
		require.Equal(t, want, store.EventPatternKnown(p), p)
	}
}
