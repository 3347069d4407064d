package api

import (
	"errors"
	"fmt"
	"net/url"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	"github.com/better-compute/better-compute/pkg/store"
)

// watchTypePattern is the rule of computev1.WatchRequest.types items
// (compute.proto), restated.
var watchTypePattern = regexp.MustCompile(`^[a-z_]+(\.[a-z_]+)*(\.\*)?$`)

// FuzzWatchQuery feeds an arbitrary query string of GET WatchPath to
// parseWatchQuery and the accepted type patterns to checkTypePatterns, the
// checks a watch runs before it reads events. A refusal is InvalidArgument
// naming the parameter (types[i] for a pattern that matches no event type,
// the first such); an accepted query has at most 32 patterns of the
// proto's form, each a trimmed non-empty entry of the types parameters in
// order, a non-negative after and no from_start with it, and it
// round-trips: written back as a query, it parses to the same request.
// Patterns checkTypePatterns accepts each match an event type, as a
// pattern is documented to (exact, or a prefix ending in ".*").
func FuzzWatchQuery(f *testing.F) {
	for _, q := range []string{"", "types=node.*,reservation.active&after=42", "types=node.*&types=command.*,,&from_start=true",
		"types=", "types=%20node.cordoned%20", "after=-1", "after=9223372036854775808", "after=1&after=2", "from_start=maybe",
		"from_start=1&after=3", "from_start=0&after=3", "types=node", "types=nodes.*", "types=*", "types=node.*.*", "types=NODE.*",
		"types=a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q,r,s,t,u,v,w,x,y,z,aa,bb,cc,dd,ee,ff,gg", "types=node.%00", "%zz", "types=command.queued;after=1",
		"types=" + strings.Repeat("a", 65), "after=+5", "after=0x10", "from_start"} {
		f.Add(q)
	}

	f.Fuzz(func(t *testing.T, raw string) {
		q, err := url.ParseQuery(raw)
		if err != nil {
			return // net/http gives the handler what parses of it; the fuzzer covers those queries too
		}
		req, err := parseWatchQuery(q)
		if err != nil {
			if req != nil {
				t.Fatalf("a request and an error for %q: %v", raw, err)
			}
			requireParamError(t, err, "types", "after", "from_start")
			return
		}
		if req.GetAfterId() < 0 || (req.GetFromStart() && req.GetAfterId() != 0) || len(req.GetTypes()) > 32 {
			t.Fatalf("accepted %q as %v", raw, req)
		}
		var entries []string
		for _, list := range q["types"] {
			for _, e := range strings.Split(list, ",") {
				if e = strings.TrimSpace(e); e != "" {
					entries = append(entries, e)
				}
			}
		}
		if !slices.Equal(entries, req.GetTypes()) {
			t.Fatalf("query %q gave types %q, want %q", raw, req.GetTypes(), entries)
		}
		for _, p := range req.GetTypes() {
			if len(p) > 64 || !watchTypePattern.MatchString(p) {
				t.Fatalf("accepted the type pattern %q", p)
			}
		}
		back := url.Values{}
		if len(req.GetTypes()) > 0 {
			back.Set("types", strings.Join(req.GetTypes(), ","))
		}
		if req.GetAfterId() != 0 {
			back.Set("after", strconv.FormatInt(req.GetAfterId(), 10))
		}
		if req.GetFromStart() {
			back.Set("from_start", "true")
		}
		again, err := parseWatchQuery(back)
		if err != nil || !proto.Equal(again, req) {
			t.Fatalf("request %v, written as %q, parses to %v, %v", req, back.Encode(), again, err)
		}

		err = checkTypePatterns(req.GetTypes())
		first := slices.IndexFunc(req.GetTypes(), func(p string) bool { return !matchesSomeType(p) })
		switch {
		case first < 0 && err != nil:
			t.Fatalf("refused patterns %q that each match an event type: %v", req.GetTypes(), err)
		case first >= 0 && err == nil:
			t.Fatalf("accepted the pattern %q, which matches no event type", req.GetTypes()[first])
		case first >= 0:
			requireParamError(t, err, fmt.Sprintf("types[%d]: ", first))
		}
	})
}

// matchesSomeType reports whether the type pattern p matches one of
// store.EventTypes, as the patterns are documented: an exact type, or a
// prefix ending in ".*".
func matchesSomeType(p string) bool {
	return slices.ContainsFunc(store.EventTypes, func(typ string) bool {
		prefix, ok := strings.CutSuffix(p, "*")
		return typ == p || (ok && strings.HasSuffix(prefix, ".") && strings.HasPrefix(typ, prefix))
	})
}

// requireParamError fails unless err is InvalidArgument with a message
// that contains one of names.
func requireParamError(t *testing.T, err error, names ...string) {
	t.Helper()
	var cerr *connect.Error
	if !errors.As(err, &cerr) || cerr.Code() != connect.CodeInvalidArgument {
		t.Fatalf("not an InvalidArgument Connect error: %T %v", err, err)
	}
	for _, n := range names {
		if strings.Contains(cerr.Message(), n) {
			return
		}
	}
	t.Fatalf("error %q names none of %q", cerr.Message(), names)
}
