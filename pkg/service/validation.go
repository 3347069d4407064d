package service

import (
	"context"
	"errors"
	"strings"
	"unicode"
	"unicode/utf8"

	"buf.build/go/protovalidate"
	"connectrpc.com/connect"
	"connectrpc.com/validate"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Validate checks msg against its proto's rules (protovalidate) and
// returns nil, or the InvalidArgument error whose message is
// ViolationsText's, with the violations (buf.validate.Violations) as its
// detail. Every service words a refusal of its protos' rules this way:
// HandlerOptions' interceptors for requests, Validate for what a handler
// checks itself (a session's messages, a watch's query, a tunnel frame).
func Validate(msg proto.Message, options ...protovalidate.ValidationOption) error {
	err := protovalidate.Validate(msg, options...)
	if err == nil {
		return nil
	}
	return invalidArgument(connect.NewError(connect.CodeInvalidArgument, err))
}

// ViolationsText is the reason of a refusal of a proto's rules in the
// project's words: each violation as "<field>: <reason>" (the field's path
// in proto names, e.g. "acceptance.timeout" or "types[2]"; the rule's id
// in brackets when it has no message), joined by "; ". A violation of no
// field (a message's own rule) is its reason alone. err that is not a
// *protovalidate.ValidationError is its Error().
func ViolationsText(err error) string {
	var verr *protovalidate.ValidationError
	if !errors.As(err, &verr) {
		return err.Error()
	}
	parts := make([]string, 0, len(verr.Violations))
	for _, v := range verr.Violations {
		reason := v.Proto.GetMessage()
		if reason == "" {
			reason = "[" + v.Proto.GetRuleId() + "]"
		}
		if path := protovalidate.FieldPathString(v.Proto.GetField()); path != "" {
			reason = path + ": " + reason
		}
		parts = append(parts, reason)
	}
	return strings.Join(parts, "; ")
}

// invalidArgument returns err reworded by ViolationsText when it is an
// InvalidArgument refusal of protovalidate's (with its details), else err
// as it is.
func invalidArgument(err error) error {
	var (
		verr *protovalidate.ValidationError
		cerr *connect.Error
	)
	if err == nil || !errors.As(err, &verr) || !errors.As(err, &cerr) || cerr.Code() != connect.CodeInvalidArgument {
		return err
	}
	out := connect.NewError(connect.CodeInvalidArgument, errors.New(ViolationsText(verr)))
	if d, derr := connect.NewErrorDetail(verr.ToProto()); derr == nil {
		out.AddDetail(d)
	}
	return out
}

// Validation returns the interceptors that check every request message
// against its proto's rules, outermost first: the rewording of refusals
// (InvalidArgument "<field>: <reason>", ViolationsText), then
// connectrpc.com/validate, unary and streaming alike. HandlerOptions
// includes them; a handler that goes without HandlerOptions takes them
// alone. It is ValidationWith no RuleChecks.
func Validation() []connect.Interceptor { return ValidationWith(nil) }

// ValidationWith is Validation whose connectrpc.com/validate interceptor
// validates with checks: a request message that a RuleCheck of checks
// passes is not walked by protovalidate.
func ValidationWith(checks RuleChecks) []connect.Interceptor {
	return []connect.Interceptor{rewordValidation{}, validate.NewInterceptor(validate.WithValidator(checks))}
}

// RuleCheck checks a request message by hand against every rule its proto
// gives it and the messages in it, and reports whether they all hold. A
// hot request checked by hand skips protovalidate, whose walk of a message
// by reflection, regular expressions and CEL programs costs a call
// microseconds and allocations; one the check does not pass goes to
// protovalidate, so that a refusal keeps its words. A RuleCheck may answer
// false for a message that keeps the rules (protovalidate then passes it),
// never true for one that breaks a rule: a test should pin the rules it
// checks against the proto's.
type RuleCheck func(proto.Message) bool

// RuleChecks are a service's RuleChecks, by the full name of the message
// each checks. It is a protovalidate.Validator: nil, or a map without the
// message's check, is protovalidate's global validator.
type RuleChecks map[protoreflect.FullName]RuleCheck

// Validate reports nil when msg's RuleCheck passes it, and otherwise what
// protovalidate reports (protovalidate.Validate with options).
func (c RuleChecks) Validate(msg proto.Message, options ...protovalidate.ValidationOption) error {
	if check := c[msg.ProtoReflect().Descriptor().FullName()]; check != nil && len(options) == 0 && check(msg) {
		return nil
	}
	return protovalidate.Validate(msg, options...)
}

// rewordValidation rewords the protovalidate refusals that calls return
// (invalidArgument).
type rewordValidation struct{}

func (rewordValidation) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		res, err := next(ctx, req)
		if req.Spec().IsClient {
			return res, err
		}
		return res, invalidArgument(err)
	}
}

func (rewordValidation) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (rewordValidation) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return invalidArgument(next(ctx, conn))
	}
}

// OneLine reports whether c may stand in text shown to people on one line:
// it is the character class of the proto rule pattern
// "^[^\p{Cc}\p{Cf}\p{Zl}\p{Zp}]*$" (no control, format, line- or
// paragraph-separator character), for the hand checks of those rules
// (RuleCheck). A string that is not UTF-8 never reaches it (proto3 strings
// are checked when decoded); RE2 would read such a byte as U+FFFD, which it
// allows too.
func OneLine(c rune) bool {
	if c < utf8.RuneSelf {
		// ASCII: Cc is U+0000–U+001F and U+007F; Cf, Zl and Zp hold none.
		return c >= 0x20 && c != 0x7F
	}
	return !unicode.In(c, unicode.Cc, unicode.Cf, unicode.Zl, unicode.Zp)
}
