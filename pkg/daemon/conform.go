package daemon

import (
	"errors"
	"regexp"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"

	"buf.build/gen/go/bufbuild/protovalidate/protocolbuffers/go/buf/validate"
	"buf.build/go/protovalidate"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Conform returns m as the control plane accepts it. The gateway checks
// every session message against gateway.proto's protovalidate rules and
// ends a session whose message breaks one, and JoinService refuses a Join
// whose claims break join.proto's; the daemon sends text it does not
// control (a command's error and output, what the hardware reports, an SSH
// client's user name), and an update answered from the journal at every
// redelivery would end every session until the command's deadline. So a
// message that breaks a rule is sent as a copy with each offending string
// fitted to its field's rules (fitString) and each list cut to its
// max_items; m itself, which may be the journal's, is not changed. It
// returns m and nil when m keeps the rules, else the copy and the
// violations m had (names of fields and rules, never values). A rule that
// no fitting of strings can meet (a required field left empty) is still
// broken in the copy.
func Conform[M proto.Message](m M) (M, error) {
	err := protovalidate.Validate(m)
	if err == nil {
		return m, nil
	}
	c := proto.Clone(m).(M)
	fitMessage(c.ProtoReflect())
	return c, err
}

// fitMessage fits every string field of m and of the messages it holds to
// its rules, in place.
func fitMessage(m protoreflect.Message) {
	var fields []protoreflect.FieldDescriptor
	m.Range(func(fd protoreflect.FieldDescriptor, _ protoreflect.Value) bool {
		fields = append(fields, fd)
		return true
	})
	for _, fd := range fields {
		rules, _ := proto.GetExtension(fd.Options(), validate.E_Field).(*validate.FieldRules)
		switch {
		case fd.IsMap():
			// The daemon sends no map.
		case fd.IsList():
			l := m.Mutable(fd).List()
			if n := rules.GetRepeated().GetMaxItems(); n > 0 && uint64(l.Len()) > n {
				l.Truncate(int(n))
			}
			items := rules.GetRepeated().GetItems().GetString()
			for i := range l.Len() {
				switch fd.Kind() {
				case protoreflect.MessageKind, protoreflect.GroupKind:
					fitMessage(l.Get(i).Message())
				case protoreflect.StringKind:
					s := l.Get(i).String()
					l.Set(i, protoreflect.ValueOfString(fitString(s, items, func(v string) bool {
						return keepsRules(m, fd, func(p protoreflect.Message) {
							p.Mutable(fd).List().Append(protoreflect.ValueOfString(v))
						})
					})))
				}
			}
		case fd.Kind() == protoreflect.MessageKind || fd.Kind() == protoreflect.GroupKind:
			fitMessage(m.Mutable(fd).Message())
		case fd.Kind() == protoreflect.StringKind:
			s := m.Get(fd).String()
			m.Set(fd, protoreflect.ValueOfString(fitString(s, rules.GetString(), func(v string) bool {
				return keepsRules(m, fd, func(p protoreflect.Message) { p.Set(fd, protoreflect.ValueOfString(v)) })
			})))
		}
	}
}

// keepsRules reports whether a message of m's type with only fd set (by
// set) has no violation on fd: how fitString asks protovalidate about one
// value of one field, whatever rules it has (lengths, patterns, hostname).
func keepsRules(m protoreflect.Message, fd protoreflect.FieldDescriptor, set func(protoreflect.Message)) bool {
	p := m.Type().New()
	set(p)
	err := protovalidate.Validate(p.Interface())
	if err == nil {
		return true
	}
	var verr *protovalidate.ValidationError
	if !errors.As(err, &verr) {
		return false
	}
	for _, v := range verr.Violations {
		if v.FieldDescriptor != nil && v.FieldDescriptor.FullName() == fd.FullName() {
			return false
		}
	}
	return true
}

// ellipsis ends a text fitString cut, where the field's pattern allows it.
const ellipsis = "…"

// fitString returns s when keeps(s), else s fitted to r: invalid UTF-8
// replaced, every character r.pattern refuses replaced (a space for white
// space, else U+FFFD or "?", whichever the pattern takes; the patterns of
// gateway.proto are one character class repeated, "^[…]*$"), cut to
// r.max_len characters and r.max_bytes bytes (ending with "…" where the
// pattern allows it). When even that breaks a rule (a hostname that is
// none), it returns "" if the field may be empty, and the fitted text
// otherwise (the gateway then refuses the message, naming the field).
func fitString(s string, r *validate.StringRules, keeps func(string) bool) string {
	if keeps(s) {
		return s
	}
	s = strings.ToValidUTF8(s, "\uFFFD")
	re := pattern(r.GetPattern())
	allowed := func(t string) bool { return re == nil || re.MatchString(t) }
	if re != nil {
		var b strings.Builder
		for _, c := range s {
			if allowed(string(c)) {
				b.WriteRune(c)
				continue
			}
			for _, rep := range []string{" ", "\uFFFD", "?"} {
				if (rep != " " || unicode.IsSpace(c)) && allowed(rep) {
					b.WriteString(rep)
					break
				}
			}
		}
		s = b.String()
	}
	tail := ""
	if allowed(ellipsis) {
		tail = ellipsis
	}
	if n := r.GetMaxLen(); n > 0 && uint64(utf8.RuneCountInString(s)) > n {
		s = cutRunes(s, int(n)-utf8.RuneCountInString(tail)) + tail
	}
	if n := r.GetMaxBytes(); n > 0 && uint64(len(s)) > n {
		s = cutBytes(s, int(n)-len(tail)) + tail
	}
	if !keeps(s) && keeps("") {
		return ""
	}
	return s
}

// cutRunes returns the first n characters of s (none when n < 1).
func cutRunes(s string, n int) string {
	for i := range s {
		if n <= 0 {
			return s[:i]
		}
		n--
	}
	return s
}

// cutBytes returns the longest prefix of s of at most n bytes that ends on
// a character boundary.
func cutBytes(s string, n int) string {
	if n <= 0 {
		return ""
	}
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// patterns caches the compiled patterns of the rules, by source.
var patterns sync.Map

// pattern returns the compiled pattern p, nil when p is empty or does not
// compile (protovalidate then refuses every value, and nothing fits).
func pattern(p string) *regexp.Regexp {
	if p == "" {
		return nil
	}
	if re, ok := patterns.Load(p); ok {
		return re.(*regexp.Regexp)
	}
	re, err := regexp.Compile(p)
	if err != nil {
		return nil
	}
	patterns.Store(p, re)
	return re
}
