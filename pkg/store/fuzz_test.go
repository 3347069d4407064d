package store

import (
	"regexp"
	"slices"
	"strings"
	"testing"
)

// apiTypePattern is the rule of computev1.WatchRequest.types items
// (compute.proto): the type patterns the API lets reach an EventFilter.
var apiTypePattern = regexp.MustCompile(`^[a-z_]+(\.[a-z_]+)*(\.\*)?$`)

// FuzzEventFilter feeds arbitrary type patterns (a comma-separated list),
// an event type and a tenant to the watch's filter. EventFilter.Matches,
// the Go twin, agrees with what ScanEvents' SQL selects from split (an exact
// type, or starts_with a prefix; every type without patterns) and with the
// scope; for the patterns the API accepts, matching is as documented (an
// exact type, or a prefix ending in ".*" that keeps its dot), and
// EventPatternKnown says whether a pattern matches one of EventTypes.
func FuzzEventFilter(f *testing.F) {
	for _, s := range [][3]string{
		{"node.*", EventNodeCordoned, "ten_a"}, {"node.*", "nodes.x", "ten_a"}, {"node.*", "node", ""},
		{"reservation.active,command.*", EventCommandQueued, "ten_b"}, {"", EventNodeJoined, ""}, {"node*", "nodes.x", "ten_a"},
		{"*", "anything", "ten_a"}, {"node.cordoned", "node.cordoned.x", "ten_a"}, {"node.*.*", "node.a.b", "ten_a"},
		{"command.queued,,node.*", "node.revoked", "ten_a"},
	} {
		f.Add(s[0], s[1], s[2])
	}

	f.Fuzz(func(t *testing.T, list, typ, tenant string) {
		var patterns []string
		if list != "" {
			patterns = strings.Split(list, ",")
		}
		e := Event{ID: 1, TenantID: tenant, Type: typ}
		filter := EventFilter{Scope: AllTenants, Types: patterns}
		exact, prefixes := filter.split()
		sql := len(patterns) == 0 || slices.Contains(exact, typ) ||
			slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(typ, p) })
		if got := filter.Matches(e); got != sql {
			t.Fatalf("patterns %q, type %q: Matches %v, ScanEvents' SQL %v", patterns, typ, got, sql)
		}
		for _, scope := range []Scope{TenantScope("ten_a"), TenantScope(tenant), {}} {
			scoped := EventFilter{Scope: scope, Types: patterns}
			if got, want := scoped.Matches(e), sql && scope.Includes(tenant); got != want {
				t.Fatalf("scope %v, tenant %q: Matches %v, want %v", scope, tenant, got, want)
			}
		}
		for _, p := range patterns {
			if len(p) > 64 || !apiTypePattern.MatchString(p) {
				continue
			}
			one := EventFilter{Scope: AllTenants, Types: []string{p}}
			prefix, wild := strings.CutSuffix(p, "*")
			if got, want := one.Matches(e), typ == p || (wild && strings.HasPrefix(typ, prefix)); got != want {
				t.Fatalf("pattern %q, type %q: Matches %v, want %v", p, typ, got, want)
			}
			known := slices.ContainsFunc(EventTypes, func(et string) bool { return one.Matches(Event{Type: et}) })
			if EventPatternKnown(p) != known {
				t.Fatalf("EventPatternKnown(%q) = %v, want %v", p, !known, known)
			}
		}
	})
}
