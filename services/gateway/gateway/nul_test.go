package gateway_test

import (
	"errors"
	"strings"
	"testing"

	"buf.build/go/protovalidate"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/reflect/protoreflect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// stringField is a string field reachable from SessionRequest: the fields
// leading to it (each a message field) and its own.
type stringField struct {
	path []protoreflect.FieldDescriptor
}

// name is the field's path as protovalidate writes it, with index 0 for a
// repeated field on the way.
func (f stringField) name() string {
	parts := make([]string, len(f.path))
	for i, fd := range f.path {
		parts[i] = string(fd.Name())
		if fd.IsList() && i < len(f.path)-1 {
			parts[i] += "[0]"
		}
	}
	return strings.Join(parts, ".")
}

// stringFields returns every string field (singular, repeated, map key or
// value) of the messages reachable from md, outside google.protobuf.
func stringFields(md protoreflect.MessageDescriptor, path []protoreflect.FieldDescriptor, seen map[protoreflect.FullName]bool) []stringField {
	if seen[md.FullName()] || strings.HasPrefix(string(md.FullName()), "google.protobuf.") {
		return nil
	}
	seen[md.FullName()] = true
	defer delete(seen, md.FullName())
	var out []stringField
	fields := md.Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		p := append(append([]protoreflect.FieldDescriptor(nil), path...), fd)
		switch {
		case fd.IsMap():
			if fd.MapKey().Kind() == protoreflect.StringKind || fd.MapValue().Kind() == protoreflect.StringKind {
				out = append(out, stringField{path: p})
			}
		case fd.Kind() == protoreflect.StringKind:
			out = append(out, stringField{path: p})
		case fd.Message() != nil:
			out = append(out, stringFields(fd.Message(), p, seen)...)
		}
	}
	return out
}

// withNUL returns a SessionRequest whose field f (and, for a map, each
// key and value) holds a NUL.
func withNUL(f stringField) *gatewayv1.SessionRequest {
	req := &gatewayv1.SessionRequest{}
	m := req.ProtoReflect()
	for _, fd := range f.path[:len(f.path)-1] {
		if fd.IsList() {
			l := m.Mutable(fd).List()
			v := l.NewElement()
			l.Append(v)
			m = v.Message()
			continue
		}
		m = m.Mutable(fd).Message()
	}
	fd := f.path[len(f.path)-1]
	const bad = "a\x00b"
	switch {
	case fd.IsMap():
		mp := m.Mutable(fd).Map()
		key, val := protoreflect.ValueOfString("k").MapKey(), protoreflect.ValueOfString(bad)
		if fd.MapKey().Kind() == protoreflect.StringKind {
			key = protoreflect.ValueOfString(bad).MapKey()
		}
		if fd.MapValue().Kind() != protoreflect.StringKind {
			val = mp.NewValue()
		}
		mp.Set(key, val)
	case fd.IsList():
		m.Mutable(fd).List().Append(protoreflect.ValueOfString(bad))
	default:
		m.Set(fd, protoreflect.ValueOfString(bad))
	}
	return req
}

// TestEverySessionStringRefusesNUL checks that gateway.proto gives every
// string a daemon can send in a Session message a rule that refuses a NUL
// (which PostgreSQL text and jsonb cannot hold), so that checkMessage,
// which every message passes first, keeps NUL out of the database and the
// decoders need not.
func TestEverySessionStringRefusesNUL(t *testing.T) {
	t.Parallel()
	fields := stringFields((&gatewayv1.SessionRequest{}).ProtoReflect().Descriptor(), nil, map[protoreflect.FullName]bool{})
	require.NotEmpty(t, fields)
	var missing []string
	for _, f := range fields {
		err := protovalidate.Validate(withNUL(f))
		var verr *protovalidate.ValidationError
		refused := false
		if errors.As(err, &verr) {
			for _, v := range verr.Violations {
				if strings.HasPrefix(protovalidate.FieldPathString(v.Proto.GetField()), f.name()) {
					refused = true
				}
			}
		}
		if !refused {
			missing = append(missing, f.name())
		}
	}
	require.Empty(t, missing, "string fields of Session messages whose rules let a NUL through")
}
