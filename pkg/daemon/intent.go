package daemon

import (
	"crypto/ed25519"

	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/pki"
)

// Reasons of refused intent (signedIntent), reported as CommandUpdate.error
// of a FAILED command and as SpecRefused.reason.
const (
	// ErrTextCommandUnsigned: the command carries no signature.
	ErrTextCommandUnsigned = "refused: the command has no signature and this node requires signed intent"
	// ErrTextCommandBadSignature: the signature is not the command-signing
	// root's over this command for this node.
	ErrTextCommandBadSignature = "refused: the command's signature does not verify against the command-signing root for this node"
	// ErrTextSpecUnsigned: the desired state carries no signature.
	ErrTextSpecUnsigned = "refused: the desired state has no signature and this node requires signed intent"
	// ErrTextSpecBadSignature: the signature is not the command-signing
	// root's over this generation and spec for this node.
	ErrTextSpecBadSignature = "refused: the desired state's signature does not verify against the command-signing root for this node"
)

// deterministic is the encoding intent signatures cover.
var deterministic = proto.MarshalOptions{Deterministic: true}

// verifyCommand returns why c must be refused, or "" when it may run: always
// "" without a command-signing root.
func (a *Agent) verifyCommand(c *gatewayv1.Command) string {
	if a.cfg.CommandSigningRoot == nil {
		return ""
	}
	return VerifyCommand(a.cfg.CommandSigningRoot, a.cfg.NodeID, c)
}

// verifySpec returns why ds must be refused, or "" when it may be applied:
// always "" without a command-signing root.
func (a *Agent) verifySpec(ds *gatewayv1.DesiredState) string {
	if a.cfg.CommandSigningRoot == nil {
		return ""
	}
	return VerifySpec(a.cfg.CommandSigningRoot, a.cfg.NodeID, ds)
}

// VerifyCommand checks the signature of c, a Command delivered to nodeID,
// against the command-signing root: Ed25519 (RFC 8032) over pkg/pki
// CommandSigningInput(nodeID, the deterministic encoding of c with its
// signature empty). It returns "" when the signature verifies, else the
// reason to refuse c (ErrTextCommandUnsigned, ErrTextCommandBadSignature).
func VerifyCommand(root ed25519.PublicKey, nodeID string, c *gatewayv1.Command) string {
	if len(c.GetSignature()) == 0 {
		return ErrTextCommandUnsigned
	}
	unsigned := proto.CloneOf(c)
	unsigned.Signature = nil
	b, err := deterministic.Marshal(unsigned)
	if err != nil || !pki.VerifyIntent(root, pki.CommandSigningInput(nodeID, b), c.GetSignature()) {
		return ErrTextCommandBadSignature
	}
	return ""
}

// VerifySpec checks the signature of ds, a DesiredState delivered to nodeID,
// against the command-signing root: Ed25519 over pkg/pki
// SpecSigningInput(nodeID, the deterministic encoding of ds with its
// signature empty). It returns "" when the signature verifies, else the
// reason to refuse ds (ErrTextSpecUnsigned, ErrTextSpecBadSignature).
func VerifySpec(root ed25519.PublicKey, nodeID string, ds *gatewayv1.DesiredState) string {
	if len(ds.GetSignature()) == 0 {
		return ErrTextSpecUnsigned
	}
	unsigned := proto.CloneOf(ds)
	unsigned.Signature = nil
	b, err := deterministic.Marshal(unsigned)
	if err != nil || !pki.VerifyIntent(root, pki.SpecSigningInput(nodeID, b), ds.GetSignature()) {
		return ErrTextSpecBadSignature
	}
	return ""
}
