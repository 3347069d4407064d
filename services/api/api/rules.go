package api

import (
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/service"
)

// ruleChecks are the API's requests checked by hand against their proto's
// rules (service.RuleCheck): RunCommand's, one per command, whose
// request_id rule is a regular expression that protovalidate ran on every
// call. TestRuleChecksPinTheProtosRules pins the rules each checks.
var ruleChecks = service.RuleChecks{
	(&computev1.RunCommandRequest{}).ProtoReflect().Descriptor().FullName(): func(m proto.Message) bool {
		r, ok := m.(*computev1.RunCommandRequest)
		return ok && runCommandHolds(r)
	},
}

// Limits of RunCommandRequest's rules (compute.proto), in characters.
const (
	maxRunCommandNodeID    = 64
	maxRunCommandRequestID = 128
	// maxRunCommandTimeout is timeout's lte, in seconds; its gte is 1 s.
	maxRunCommandTimeout = 86400
)

// runCommandHolds reports whether r keeps every rule of RunCommandRequest:
// node_id of 1 to 64 characters, kind one of the four, timeout (when set) a
// valid duration from 1 s to 24 h, request_id of at most 128 characters
// none of which is a control, format or line-separator character.
func runCommandHolds(r *computev1.RunCommandRequest) bool {
	if n := utf8.RuneCountInString(r.GetNodeId()); n < 1 || n > maxRunCommandNodeID {
		return false
	}
	switch r.GetKind() {
	case "diag.nvml", "inventory.refresh", "logs.collect", "node.reboot":
	default:
		return false
	}
	if t := r.GetTimeout(); t != nil {
		// A valid Duration has seconds and nanos of one sign, nanos below
		// a second: from 1 s to 24 h exactly when its seconds are 1 to
		// 86,399, or 86,400 with no nanos.
		if t.CheckValid() != nil || t.GetSeconds() < 1 || t.GetSeconds() > maxRunCommandTimeout ||
			(t.GetSeconds() == maxRunCommandTimeout && t.GetNanos() != 0) {
			return false
		}
	}
	n := 0
	for _, c := range r.GetRequestId() {
		if !service.OneLine(c) {
			return false
		}
		n++
	}
	return n <= maxRunCommandRequestID
}
