// Package servicetest holds test helpers for the settings pkg/service
// shares among services. Tests of every service use it; it is imported by
// tests only.
package servicetest

import (
	"crypto/x509"
	"path/filepath"
	"strings"
	"testing"
	"time"

	validatepb "buf.build/gen/go/bufbuild/protovalidate/protocolbuffers/go/buf/validate"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/runtime/protoimpl"

	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/service"
)

// ServingCert writes a serving certificate for hosts (DNS names or IP
// addresses, as pki.CA.IssueServing takes them), valid for an hour from
// now on the real clock, into a temporary directory of t, and returns the
// TLS setting of its files (serving.crt, serving.key) and a pool trusting
// its CA. The CA is the serving CA of pkiDir (pki.ServingCACert and
// pki.ServingCAKey), or a fresh one when pkiDir is "". It fails t on any
// error.
func ServingCert(t testing.TB, pkiDir string, hosts ...string) (service.TLS, *x509.CertPool) {
	t.Helper()
	now := clock.New().Now()
	if pkiDir == "" {
		pkiDir = t.TempDir()
		_, err := pki.Init(pkiDir, pki.InitOptions{}, now)
		require.NoError(t, err)
	}
	ca, err := pki.LoadCA(filepath.Join(pkiDir, pki.ServingCACert), filepath.Join(pkiDir, pki.ServingCAKey))
	require.NoError(t, err)
	cert, key, err := ca.IssueServing(hosts, now, time.Hour)
	require.NoError(t, err)
	dir := t.TempDir()
	s := service.TLS{TLSCert: filepath.Join(dir, "serving.crt"), TLSKey: filepath.Join(dir, "serving.key")}
	require.NoError(t, pki.WriteCert(s.TLSCert, cert))
	require.NoError(t, pki.WriteKey(s.TLSKey, key))
	roots := x509.NewCertPool()
	roots.AddCert(ca.Cert)
	return s, roots
}

// ProtoRules returns the protovalidate rules of md and of every message its
// fields hold, in protobuf's text form with its spacing collapsed, keyed by
// the full name of the field, "<message>:message" and "<oneof>:oneof"
// (rules that are empty left out). A test that pins them fails the day a
// proto's rule changes under a hand-written check of it.
func ProtoRules(md protoreflect.MessageDescriptor) map[protoreflect.FullName]string {
	text := func(m proto.Message) string { return strings.Join(strings.Fields(protoimpl.X.MessageStringOf(m)), " ") }
	rules := map[protoreflect.FullName]string{}
	seen := map[protoreflect.FullName]bool{}
	var walk func(md protoreflect.MessageDescriptor)
	walk = func(md protoreflect.MessageDescriptor) {
		if seen[md.FullName()] {
			return
		}
		seen[md.FullName()] = true
		if r := proto.GetExtension(md.Options(), validatepb.E_Message).(*validatepb.MessageRules); r != nil && text(r) != "" {
			rules[md.FullName()+":message"] = text(r)
		}
		for i := range md.Oneofs().Len() {
			o := md.Oneofs().Get(i)
			if r := proto.GetExtension(o.Options(), validatepb.E_Oneof).(*validatepb.OneofRules); r != nil && text(r) != "" {
				rules[o.FullName()+":oneof"] = text(r)
			}
		}
		for i := range md.Fields().Len() {
			fd := md.Fields().Get(i)
			if r := proto.GetExtension(fd.Options(), validatepb.E_Field).(*validatepb.FieldRules); r != nil && text(r) != "" {
				rules[fd.FullName()] = text(r)
			}
			if fd.Message() != nil {
				walk(fd.Message())
			}
		}
	}
	walk(md)
	return rules
}

// RequireSameRefusals requires that check, a hand check of a message's rules
// (service.RuleCheck behind it), answers each of msgs as want,
// protovalidate, does: nil for the same messages, and otherwise the same
// error text. It returns how many of msgs passed.
func RequireSameRefusals[M proto.Message](t testing.TB, msgs []M, check, want func(M) error) (passed int) {
	t.Helper()
	for _, m := range msgs {
		got, w := check(m), want(m)
		if w == nil {
			require.NoError(t, got, "%v", m)
			passed++
			continue
		}
		require.Error(t, got, "%v", m)
		require.Equal(t, w.Error(), got.Error(), "%v", m)
	}
	return passed
}
