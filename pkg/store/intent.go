package store

// Signed intent (docs/architecture.md, "Commands": signed intent): with the deployment option on,
// every command and every NodeSpec generation carries the command-signing
// root's Ed25519 signature (RFC 8032), made when the row is written and
// stored beside it (commands.signature, nodes.spec_signature). The gateway
// relays signatures untouched and never holds the key; daemons verify them
// against the root they received at Join and refuse what does not verify.
//
// A signature covers the exact message the gateway sends, so it is made from
// the row as the database returns it (jsonb normalises JSON text, timestamptz
// keeps microseconds), inside the transaction that wrote it, and both the
// signer and the gateway build the message with CommandMessage and
// DesiredStateMessage.
//
// Every store function that creates a command or changes a NodeSpec takes an
// *IntentSigner and signs before it returns (QueueAcceptanceCommands,
// AdoptNodes). A new writer does the same: write the rows, then call
// SignCommands or SignNodeSpecs with the ids in the same transaction. A spec
// changed without a new signature loses its old one (a trigger of migration
// 000003), so a forgotten signature shows as an unsigned spec, never as a
// stale one.

import (
	"context"
	"crypto/ed25519"
	"fmt"
	"path/filepath"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/pki"
)

// IntentSigner signs commands and NodeSpecs with the command-signing root. A
// nil *IntentSigner is a deployment without signedIntent: it signs nothing
// and every Sign function is a no-op.
type IntentSigner struct {
	key ed25519.PrivateKey
}

// NewIntentSigner returns a signer with key, the command-signing root's
// Ed25519 private key. It fails for a key of the wrong size.
func NewIntentSigner(key ed25519.PrivateKey) (*IntentSigner, error) {
	if len(key) != ed25519.PrivateKeySize {
		return nil, fmt.Errorf("command-signing key: want an Ed25519 private key of %d bytes, got %d", ed25519.PrivateKeySize, len(key))
	}
	return &IntentSigner{key: key}, nil
}

// LoadIntentSigner reads the command-signing root from pkiDir
// (pki.CommandSigningKey, written by `better-compute pki init`).
func LoadIntentSigner(pkiDir string) (*IntentSigner, error) {
	key, err := pki.LoadSigningKey(filepath.Join(pkiDir, pki.CommandSigningKey))
	if err != nil {
		return nil, fmt.Errorf("signedIntent: load the command-signing key: %w", err)
	}
	return NewIntentSigner(key)
}

// Public returns the command-signing root's public key, nil for a nil signer.
func (s *IntentSigner) Public() ed25519.PublicKey {
	if s == nil {
		return nil
	}
	return s.key.Public().(ed25519.PublicKey)
}

// deterministic is the encoding that signatures cover.
var deterministic = proto.MarshalOptions{Deterministic: true}

// CommandMessage returns the bc.gateway.v1.Command the gateway sends for c,
// with c.Signature as its signature. Signers sign this message with an empty
// signature, so both sides must build it here.
func CommandMessage(c SessionCommand) *gatewayv1.Command {
	return &gatewayv1.Command{
		CommandId: c.ID,
		Kind:      c.Kind,
		ArgsJson:  c.Args,
		Deadline:  timestamppb.New(c.Deadline),
		RetrySafe: c.RetrySafe,
		Signature: c.Signature,
	}
}

// DesiredStateMessage returns the bc.gateway.v1.DesiredState the gateway
// sends for a spec generation: spec is the stored NodeSpec (protojson, as in
// nodes.spec; unknown fields are dropped), signature the stored signature.
// It fails when spec is not a NodeSpec.
func DesiredStateMessage(generation int64, spec, signature []byte) (*gatewayv1.DesiredState, error) {
	ns := &gatewayv1.NodeSpec{}
	if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(spec, ns); err != nil {
		return nil, fmt.Errorf("node spec is not a NodeSpec: %w", err)
	}
	return &gatewayv1.DesiredState{Generation: generation, Spec: ns, Signature: signature}, nil
}

// CommandSignature returns the signature of command m for nodeID:
// pki.SignIntent over pki.CommandSigningInput of m's deterministic encoding
// with its signature empty. m is not modified.
func (s *IntentSigner) CommandSignature(nodeID string, m *gatewayv1.Command) ([]byte, error) {
	unsigned := proto.CloneOf(m)
	unsigned.Signature = nil
	b, err := deterministic.Marshal(unsigned)
	if err != nil {
		return nil, err
	}
	return pki.SignIntent(s.key, pki.CommandSigningInput(nodeID, b)), nil
}

// SpecSignature returns the signature of desired state m for nodeID:
// pki.SignIntent over pki.SpecSigningInput of m's deterministic encoding with
// its signature empty. m is not modified.
func (s *IntentSigner) SpecSignature(nodeID string, m *gatewayv1.DesiredState) ([]byte, error) {
	unsigned := proto.CloneOf(m)
	unsigned.Signature = nil
	b, err := deterministic.Marshal(unsigned)
	if err != nil {
		return nil, err
	}
	return pki.SignIntent(s.key, pki.SpecSigningInput(nodeID, b)), nil
}

// SignCommands signs the commands cmdIDs as stored (read back in q's
// transaction, so the signature covers what the gateway will send) and stores
// the signatures. Call it in the transaction that inserted them. A nil s does
// nothing.
func SignCommands(ctx context.Context, q DBTX, s *IntentSigner, cmdIDs []string) error {
	if s == nil || len(cmdIDs) == 0 {
		return nil
	}
	rows, err := q.Query(ctx, `SELECT id, node_id, kind, args, deadline, retry_safe FROM commands WHERE id = ANY($1)`, cmdIDs)
	if err != nil {
		return fmt.Errorf("sign commands: %w", interpretError(err))
	}
	var ids []string
	var sigs [][]byte
	for rows.Next() {
		var c SessionCommand
		var nodeID string
		if err := rows.Scan(&c.ID, &nodeID, &c.Kind, &c.Args, &c.Deadline, &c.RetrySafe); err != nil {
			rows.Close()
			return fmt.Errorf("sign commands: %w", err)
		}
		sig, err := s.CommandSignature(nodeID, CommandMessage(c))
		if err != nil {
			rows.Close()
			return fmt.Errorf("sign command %s: %w", c.ID, err)
		}
		ids = append(ids, c.ID)
		sigs = append(sigs, sig)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("sign commands: %w", interpretError(err))
	}
	if len(ids) != len(cmdIDs) {
		return fmt.Errorf("sign commands: %d of %d commands not found", len(cmdIDs)-len(ids), len(cmdIDs))
	}
	_, err = q.Exec(ctx, `UPDATE commands c SET signature = u.sig
		FROM unnest($1::text[], $2::bytea[]) AS u(id, sig) WHERE c.id = u.id`, ids, sigs)
	if err != nil {
		return fmt.Errorf("sign commands: %w", interpretError(err))
	}
	return nil
}

// SignNodeSpecs signs the current spec generation of each of nodeIDs as
// stored (read back in q's transaction) and stores the signatures
// (nodes.spec_signature). Call it in the transaction that changed the specs,
// after the change. A nil s does nothing.
func SignNodeSpecs(ctx context.Context, q DBTX, s *IntentSigner, nodeIDs []string) error {
	if s == nil || len(nodeIDs) == 0 {
		return nil
	}
	rows, err := q.Query(ctx, `SELECT id, spec_generation, spec FROM nodes WHERE id = ANY($1)`, nodeIDs)
	if err != nil {
		return fmt.Errorf("sign node specs: %w", interpretError(err))
	}
	var ids []string
	var sigs [][]byte
	for rows.Next() {
		var id string
		var gen int64
		var spec []byte
		if err := rows.Scan(&id, &gen, &spec); err != nil {
			rows.Close()
			return fmt.Errorf("sign node specs: %w", err)
		}
		m, err := DesiredStateMessage(gen, spec, nil)
		if err == nil {
			var sig []byte
			if sig, err = s.SpecSignature(id, m); err == nil {
				ids = append(ids, id)
				sigs = append(sigs, sig)
			}
		}
		if err != nil {
			rows.Close()
			return fmt.Errorf("sign the spec of node %s: %w", id, err)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("sign node specs: %w", interpretError(err))
	}
	if len(ids) != len(nodeIDs) {
		return fmt.Errorf("sign node specs: %d of %d nodes not found", len(nodeIDs)-len(ids), len(nodeIDs))
	}
	_, err = q.Exec(ctx, `UPDATE nodes n SET spec_signature = u.sig
		FROM unnest($1::text[], $2::bytea[]) AS u(id, sig) WHERE n.id = u.id`, ids, sigs)
	if err != nil {
		return fmt.Errorf("sign node specs: %w", interpretError(err))
	}
	return nil
}
