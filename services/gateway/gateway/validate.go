package gateway

// The hot rules of a Session message checked by hand: the string rules of a
// command update's fields and of its inventory's GPUs (gateway.proto) are
// regular expressions, which protovalidate runs per field and per GPU. They
// are checked here with loops over the text first; when every one holds,
// protovalidate checks the message without them, and when one does not, it
// checks the whole message, so that a refusal is word for word
// protovalidate's (service.Validate). A CommandUpdate, the message of every
// command's end, has every rule of its own and of the messages in it checked
// by hand (commandUpdateHolds), and skips protovalidate whenever they all
// hold: protovalidate walks each GPU of a result by reflection, allocating,
// and deep enough to grow the session goroutine's stack, which the
// collector shrinks again between commands.

import (
	"strings"
	"unicode"
	"unicode/utf8"

	"buf.build/go/protovalidate"
	"google.golang.org/protobuf/reflect/protoreflect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/service"
)

// textRule is one string rule of gateway.proto: at most maxLen characters
// (code points) or, when bytes is set, maxLen bytes, each character allowed
// by ok.
type textRule struct {
	maxLen int
	bytes  bool
	ok     func(rune) bool
}

// holds reports whether s keeps r.
func (r textRule) holds(s string) bool {
	n := 0
	for _, c := range s {
		if !r.ok(c) {
			return false
		}
		n++
	}
	if r.bytes {
		return len(s) <= r.maxLen
	}
	return n <= r.maxLen
}

// visibleASCII is the pattern "^[!-~]*$" (ids).
func visibleASCII(c rune) bool { return c >= '!' && c <= '~' }

// multiLine is CommandResult.output's pattern
// "^[^\x00-\x08\x0B-\x1F\x7F-\x9F\p{Cf}\p{Zl}\p{Zp}]*$": service.OneLine with tab and
// newline allowed.
func multiLine(c rune) bool {
	switch {
	case c <= 0x08, c >= 0x0B && c <= 0x1F, c >= 0x7F && c <= 0x9F:
		return false
	case c < utf8.RuneSelf:
		// Cf, Zl and Zp hold no ASCII character.
		return true
	}
	return !unicode.In(c, unicode.Cf, unicode.Zl, unicode.Zp)
}

// The fields checked by hand, with gateway.proto's rules for them; a change
// of those rules must be made here too (TestHandRulesMatchProto compares).
var (
	ruleError         = textRule{maxLen: 4096, ok: service.OneLine}
	ruleOutput        = textRule{maxLen: 262144, bytes: true, ok: multiLine}
	ruleDriverVersion = textRule{maxLen: 64, ok: service.OneLine}
	ruleGPUUUID       = textRule{maxLen: 64, ok: visibleASCII}
	ruleGPUModel      = textRule{maxLen: 128, ok: service.OneLine}
	ruleGPUPCIBusID   = textRule{maxLen: 32, ok: visibleASCII}
)

// The rules of a CommandUpdate's other fields, which commandUpdateHolds
// checks too (TestCommandUpdateRulesAreHandChecked pins every rule of the
// message and of those in it).
// ruleCommandID is command_id's, with its min_len of 1.
var ruleCommandID = textRule{maxLen: 64, ok: visibleASCII}

const (
	// maxHostname is Inventory.hostname's max_len, in characters.
	maxHostname = 253
	// maxGPUs is Inventory.gpus' max_items.
	maxGPUs = 64
)

// isHostname is protovalidate's string rule hostname (RFC 1123: labels of
// letters, digits and hyphens, 1 to 63 long, neither starting nor ending with
// a hyphen, at most 253 characters before an optional trailing dot, the last
// label not all digits), as buf.build/go/protovalidate checks it.
func isHostname(s string) bool {
	s = strings.TrimSuffix(s, ".")
	if len(s) > 253 {
		return false
	}
	allDigits := false
	for label := range strings.SplitSeq(s, ".") {
		if len(label) == 0 || len(label) > 63 || label[0] == '-' || label[len(label)-1] == '-' {
			return false
		}
		allDigits = true
		for i := range len(label) {
			c := label[i]
			digit := c >= '0' && c <= '9'
			if !digit && (c < 'a' || c > 'z') && (c < 'A' || c > 'Z') && c != '-' {
				return false
			}
			allDigits = allDigits && digit
		}
	}
	return !allDigits
}

// commandUpdateHolds reports whether u keeps every rule gateway.proto gives
// CommandUpdate and the messages in it: command_id, state (a defined value),
// error, the result's output, its inventory's GPU count, hostname (when set)
// and driver version, and each GPU's strings. checkMessage lets such an
// update pass without protovalidate; one that breaks a rule goes to
// protovalidate whole, so that the refusal is its.
func commandUpdateHolds(u *gatewayv1.CommandUpdate) bool {
	if id := u.GetCommandId(); id == "" || !ruleCommandID.holds(id) {
		return false
	}
	if _, ok := gatewayv1.CommandState_name[int32(u.GetState())]; !ok {
		return false
	}
	if !ruleError.holds(u.GetError()) || !ruleOutput.holds(u.GetResult().GetOutput()) {
		return false
	}
	inv := u.GetResult().GetInventory()
	if len(inv.GetGpus()) > maxGPUs || !ruleDriverVersion.holds(inv.GetDriverVersion()) {
		return false
	}
	if h := inv.GetHostname(); h != "" && (utf8.RuneCountInString(h) > maxHostname || !isHostname(h)) {
		return false
	}
	for _, g := range inv.GetGpus() {
		if !ruleGPUUUID.holds(g.GetUuid()) || !ruleGPUModel.holds(g.GetModel()) || !ruleGPUPCIBusID.holds(g.GetPciBusId()) {
			return false
		}
	}
	return true
}

// handChecked are the fields whose rules handCheck checks, which
// protovalidate skips once they hold. CommandUpdate.command_id keeps its
// min_len in protovalidate, so it is not among them.
var handChecked = func() map[protoreflect.Descriptor]bool {
	fields := func(m protoreflect.ProtoMessage, names ...protoreflect.Name) []protoreflect.Descriptor {
		var out []protoreflect.Descriptor
		for _, n := range names {
			out = append(out, m.ProtoReflect().Descriptor().Fields().ByName(n))
		}
		return out
	}
	set := map[protoreflect.Descriptor]bool{}
	for _, list := range [][]protoreflect.Descriptor{
		fields(&gatewayv1.CommandUpdate{}, "error"),
		fields(&gatewayv1.CommandResult{}, "output"),
		fields(&gatewayv1.Inventory{}, "driver_version"),
		fields(&gatewayv1.Gpu{}, "uuid", "model", "pci_bus_id"),
	} {
		for _, d := range list {
			if d == nil {
				panic("gateway: a hand-checked field is missing from gateway.proto")
			}
			set[d] = true
		}
	}
	return set
}()

// skipHandChecked is the protovalidate filter that leaves out the fields
// of handChecked.
var skipHandChecked = protovalidate.WithFilter(protovalidate.FilterFunc(
	func(_ protoreflect.Message, d protoreflect.Descriptor) bool { return !handChecked[d] }))

// handCheck reports whether every hand-checked field of req keeps its rule.
func handCheck(req *gatewayv1.SessionRequest) bool {
	var inv *gatewayv1.Inventory
	switch m := req.GetMsg().(type) {
	case *gatewayv1.SessionRequest_CommandUpdate:
		u := m.CommandUpdate
		if !ruleError.holds(u.GetError()) || !ruleOutput.holds(u.GetResult().GetOutput()) {
			return false
		}
		inv = u.GetResult().GetInventory()
	case *gatewayv1.SessionRequest_Report:
		inv = m.Report.GetInventory()
	}
	if inv == nil {
		return true
	}
	if !ruleDriverVersion.holds(inv.GetDriverVersion()) {
		return false
	}
	for _, g := range inv.GetGpus() {
		if !ruleGPUUUID.holds(g.GetUuid()) || !ruleGPUModel.holds(g.GetModel()) || !ruleGPUPCIBusID.holds(g.GetPciBusId()) {
			return false
		}
	}
	return true
}

// checkMessage checks a Session message against gateway.proto's rules:
// InvalidArgument "<field>: <reason>" for each rule it breaks, never the
// value, exactly as service.Validate words it. The hand-checked rules
// (handCheck) are tested first; protovalidate then skips them when they
// hold, and checks everything when one does not. A Heartbeat, most of what
// an idle fleet sends, is not walked: Heartbeat and the messages of its
// fields carry no rule (TestHeartbeatHasNoRules), and the oneof's rule
// (required) holds when it is set, so every heartbeat passes. Nor is a
// CommandUpdate that keeps every rule (commandUpdateHolds).
func checkMessage(req *gatewayv1.SessionRequest) error {
	if req.GetHeartbeat() != nil {
		return nil
	}
	if u := req.GetCommandUpdate(); u != nil && commandUpdateHolds(u) {
		return nil
	}
	if handCheck(req) {
		return service.Validate(req, skipHandChecked)
	}
	return service.Validate(req)
}
