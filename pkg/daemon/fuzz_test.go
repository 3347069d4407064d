package daemon_test

import (
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/daemon"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
)

// FuzzVerifyIntent feeds arbitrary bytes, decoded as a Command and as a
// DesiredState delivered to node nodeID, to the daemon's signature checks
// (VerifyCommand, VerifySpec) against the command-signing root. With
// resign false the message is checked as it came: it may pass only when it
// is one the root signed (a seed) for exactly that node, and a refusal is
// one of the documented reasons, "unsigned" exactly when there is no
// signature. With resign true the message is first signed for nodeID by the
// control plane's signer (store.IntentSigner) and sent over the wire as the
// gateway sends it: it must then pass on nodeID, so that a signature the
// control plane makes always verifies on the node, and be refused on any
// other node.
func FuzzVerifyIntent(f *testing.F) {
	key, err := pki.GenerateSigningKey()
	if err != nil {
		f.Fatal(err)
	}
	signer, err := store.NewIntentSigner(key)
	if err != nil {
		f.Fatal(err)
	}
	root := signer.Public()
	otherKey, err := pki.GenerateSigningKey()
	if err != nil {
		f.Fatal(err)
	}
	other, err := store.NewIntentSigner(otherKey)
	if err != nil {
		f.Fatal(err)
	}
	const node = "node_01JFUZZ000000000000000000"
	deadline := time.Date(2030, 5, 6, 7, 8, 9, 123456000, time.UTC)
	cmds := []*gatewayv1.Command{
		{CommandId: "cmd_01JFUZZ000000000000000000", Kind: "diag.nvml", ArgsJson: []byte(`{"verbose": true}`),
			Deadline: timestamppb.New(deadline), RetrySafe: true},
		{CommandId: "cmd_01JFUZZ000000000000000001", Kind: "reboot"},
	}
	specs := []*gatewayv1.DesiredState{
		{Generation: 7, Spec: &gatewayv1.NodeSpec{
			Allocations: []*gatewayv1.Allocation{{ReservationId: "res_01JFUZZ000000000000000000", DeviceIndexes: []int32{0, 1}}},
			Labels:      map[string]string{"bc/pool": "pool_01", "bc/site": "site_01", "a": "b"},
			SshUserCas:  []*gatewayv1.SshUserCa{{Name: "sandbox", PublicKey: "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFuzz"}}}},
		{Generation: 1},
	}
	// signedCmds and signedSpecs are what the root signed for node: the
	// only messages that may pass as they come.
	var signedCmds []*gatewayv1.Command
	var signedSpecs []*gatewayv1.DesiredState
	add := func(m proto.Message) {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(node, b, false)
		f.Add(node, b, true)
		f.Add("node_other", b, false)
	}
	for _, c := range cmds {
		for _, s := range []*store.IntentSigner{signer, other} {
			sc := proto.CloneOf(c)
			if sc.Signature, err = s.CommandSignature(node, c); err != nil {
				f.Fatal(err)
			}
			if s == signer {
				signedCmds = append(signedCmds, sc)
			}
			add(sc)
		}
		add(c)
	}
	for _, ds := range specs {
		for _, s := range []*store.IntentSigner{signer, other} {
			sd := proto.CloneOf(ds)
			if sd.Signature, err = s.SpecSignature(node, ds); err != nil {
				f.Fatal(err)
			}
			if s == signer {
				signedSpecs = append(signedSpecs, sd)
			}
			add(sd)
		}
		add(ds)
	}
	// The valid seeds pass: the target can tell good from bad.
	if r := daemon.VerifyCommand(root, node, signedCmds[0]); r != "" {
		f.Fatalf("the signed command seed was refused: %s", r)
	}
	if r := daemon.VerifySpec(root, node, signedSpecs[0]); r != "" {
		f.Fatalf("the signed spec seed was refused: %s", r)
	}

	f.Fuzz(func(t *testing.T, nodeID string, b []byte, resign bool) {
		var c gatewayv1.Command
		if proto.Unmarshal(b, &c) == nil {
			if resign {
				sig, err := signer.CommandSignature(nodeID, &c)
				if err != nil {
					t.Fatalf("the signer cannot sign command %v: %v", &c, err)
				}
				c.Signature = sig
				got := relay(t, &c)
				if r := daemon.VerifyCommand(root, nodeID, got); r != "" {
					t.Fatalf("a command signed for %q is refused on it: %s", nodeID, r)
				}
				if r := daemon.VerifyCommand(root, nodeID+"x", got); r != daemon.ErrTextCommandBadSignature {
					t.Fatalf("a command signed for %q is not refused on %q: %q", nodeID, nodeID+"x", r)
				}
			} else {
				r := daemon.VerifyCommand(root, nodeID, &c)
				switch {
				case r == "" && (nodeID != node || !slices.ContainsFunc(signedCmds, func(s *gatewayv1.Command) bool { return proto.Equal(s, &c) })):
					t.Fatalf("command %v passed on %q, which the root did not sign it for", &c, nodeID)
				case r == daemon.ErrTextCommandUnsigned && len(c.GetSignature()) != 0,
					r == daemon.ErrTextCommandBadSignature && len(c.GetSignature()) == 0:
					t.Fatalf("reason %q for a signature of %d bytes", r, len(c.GetSignature()))
				case r != "" && r != daemon.ErrTextCommandUnsigned && r != daemon.ErrTextCommandBadSignature:
					t.Fatalf("undocumented reason %q", r)
				}
			}
		}

		var ds gatewayv1.DesiredState
		if proto.Unmarshal(b, &ds) == nil {
			if resign {
				sig, err := signer.SpecSignature(nodeID, &ds)
				if err != nil {
					t.Fatalf("the signer cannot sign desired state %v: %v", &ds, err)
				}
				ds.Signature = sig
				got := relay(t, &ds)
				if r := daemon.VerifySpec(root, nodeID, got); r != "" {
					t.Fatalf("a desired state signed for %q is refused on it: %s", nodeID, r)
				}
				if r := daemon.VerifySpec(root, nodeID+"x", got); r != daemon.ErrTextSpecBadSignature {
					t.Fatalf("a desired state signed for %q is not refused on %q: %q", nodeID, nodeID+"x", r)
				}
			} else {
				r := daemon.VerifySpec(root, nodeID, &ds)
				switch {
				case r == "" && (nodeID != node || !slices.ContainsFunc(signedSpecs, func(s *gatewayv1.DesiredState) bool { return proto.Equal(s, &ds) })):
					t.Fatalf("desired state %v passed on %q, which the root did not sign it for", &ds, nodeID)
				case r == daemon.ErrTextSpecUnsigned && len(ds.GetSignature()) != 0,
					r == daemon.ErrTextSpecBadSignature && len(ds.GetSignature()) == 0:
					t.Fatalf("reason %q for a signature of %d bytes", r, len(ds.GetSignature()))
				case r != "" && r != daemon.ErrTextSpecUnsigned && r != daemon.ErrTextSpecBadSignature:
					t.Fatalf("undocumented reason %q", r)
				}
			}
		}
	})
}

// relay returns m as the daemon receives it: encoded for the wire and
// decoded again.
func relay[M proto.Message](t *testing.T, m M) M {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatalf("encode %v: %v", m, err)
	}
	out := m.ProtoReflect().New().Interface().(M)
	if err := proto.Unmarshal(b, out); err != nil {
		t.Fatalf("decode %v: %v", m, err)
	}
	return out
}
