package cli

import (
	"errors"
	"strings"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"
)

// API errors name the request's fields ("duration: must be at least 1s",
// protovalidate's and the handlers' alike: service.ViolationsText); the CLI
// shows them in the words of the command that was run, naming its flags
// and arguments (--for, POOL_ID), and describes the rules protovalidate
// states as regular expressions in words.

// ruleWords describes, in words, the patterns of the API's proto rules
// (api/proto/bc/compute/v1/compute.proto) that refusals quote: protovalidate
// says "does not match regex pattern `<pattern>`".
var ruleWords = map[string]string{
	// Names of tenants, sites and pools: min_len 1, max_len 63.
	`^[a-z0-9]([a-z0-9-]*[a-z0-9])?$`: "must be lowercase letters, digits and '-', starting and ending with a letter or a digit, at most 63 characters",
	// Regions, request ids.
	`^[^\p{Cc}\p{Cf}\p{Zl}\p{Zp}]*$`: "must not contain control, format or line-separator characters",
	// Reasons (cordon, revoke).
	`^[^\p{Cc}\x{202A}-\x{202E}\x{2066}-\x{2069}\p{Zl}\p{Zp}]*$`: "must not contain control characters, bidirectional overrides or line separators",
	// Event type patterns.
	`^[a-z_]+(\.[a-z_]+)*(\.\*)?$`: "must be an event type such as node.cordoned or a family such as node.*",
}

// describeRules is msg with each quoted pattern of ruleWords in words.
func describeRules(msg string) string {
	if !strings.Contains(msg, "regex pattern `") {
		return msg
	}
	for pattern, words := range ruleWords {
		msg = strings.ReplaceAll(msg, "does not match regex pattern `"+pattern+"`", words)
	}
	return msg
}

// fields records the flags and arguments of c by the request field they set
// ("duration": "--for"), for the errors of its API calls (inFlagWords).
func (a *app) fields(c *cobra.Command, byField map[string]string) *cobra.Command {
	if a.fieldsOf == nil {
		a.fieldsOf = map[*cobra.Command]map[string]string{}
	}
	a.fieldsOf[c] = byField
	return c
}

// inFlagWords is err with its Connect message in the words of c's flags
// (fieldWords), when c recorded its fields; other errors pass unchanged.
func (a *app) inFlagWords(c *cobra.Command, err error) error {
	if c == nil || a.fieldsOf[c] == nil {
		return err
	}
	return fieldWords(err, a.fieldsOf[c])
}

// fieldWords is err with a Connect message whose violations ("field:
// reason", joined by "; ") start with a field of byField starting with its
// flag instead ("duration: …" → "--for: …"), and whose hints "set <field>"
// and "(<field>)" say "pass <flag>" and "(<flag>)"; the code and details
// are kept. Other errors pass as
// they are.
func fieldWords(err error, byField map[string]string) error {
	var cerr *connect.Error
	if !errors.As(err, &cerr) {
		return err
	}
	msg := cerr.Message()
	parts := strings.Split(msg, "; ")
	for i, p := range parts {
		field, rest, ok := strings.Cut(p, ": ")
		if flag, known := byField[field]; ok && known {
			parts[i] = flag + ": " + rest
		}
	}
	out := strings.Join(parts, "; ")
	for field, flag := range byField {
		out = strings.ReplaceAll(out, "set "+field+" ", "pass "+flag+" ")
		out = strings.ReplaceAll(out, "("+field+")", "("+flag+")")
	}
	if out == msg {
		return err
	}
	n := connect.NewError(cerr.Code(), errors.New(out))
	for _, d := range cerr.Details() {
		n.AddDetail(d)
	}
	return n
}
