// Package tunnel holds what the three hops of a tunnel share
// (docs/architecture.md, "Tunnels"): the exec ticket, which the API issues and
// consumes and the gateway verifies, the purposes, Conn, a byte stream
// over a stream of tunnel frames (the node's SSH server reads its connection
// through one), and Terminal, what a machine's shell runs on at the node's
// end (Term implements it).
//
// A ticket is "bctk_" + base64url(JSON of Ticket) + "." + base64url(Ed25519
// signature), the signature taken with the deployment's tunnel-ticket key
// (pkg/pki TunnelTicketKey) over a domain-separated message, so that no other
// signature of the deployment's can pass for one.
package tunnel

import (
	"crypto/ed25519"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"
)

// Purposes of a tunnel.
const (
	// PurposeShell is the machine's shell on a terminal (console).
	PurposeShell = "shell"
	// PurposeSSH is the machine's SSH server: the tunnel carries the bytes
	// of one SSH connection (ssh-proxy).
	PurposeSSH = "ssh"
)

// TicketTTL is how long an exec ticket is valid after it is issued.
const TicketTTL = 60 * time.Second

// TicketPrefix starts every exec ticket.
const TicketPrefix = "bctk_"

// maxTicketLen bounds what Verify reads: a ticket is a few hundred bytes.
const maxTicketLen = 4096

// signingDomain separates ticket signatures from every other signature
// (pkg/pki uses its own domains for JoinResponses and intent).
const signingDomain = "better-compute tunnel ticket v1\x00"

// Ticket is what an exec ticket grants: one tunnel of Purpose to NodeID,
// for the caller TokenID of TenantID (and, for a sandbox, ReservationID),
// until ExpiresAt.
type Ticket struct {
	// ID is "tkt_…": the row that makes the ticket single use, and what
	// the audit log names.
	ID      string `json:"id"`
	NodeID  string `json:"node"`
	Purpose string `json:"purpose"`
	// TenantID and TokenID are the caller's: the tunnel is authorized again
	// with that token while it is open.
	TenantID string `json:"tenant"`
	TokenID  string `json:"token"`
	// ReservationID is the active reservation a sandbox SSH tunnel comes
	// from; empty for a shell or break-glass SSH.
	ReservationID string `json:"reservation,omitempty"`
	// ExpiresAt is when the ticket stops opening a tunnel (whole seconds).
	ExpiresAt time.Time `json:"-"`
	Expires   int64     `json:"exp"`
}

// Errors of Verify. A refusal wraps one of them.
var (
	ErrMalformed    = errors.New("ticket is malformed")
	ErrBadSignature = errors.New("ticket signature is not valid")
	ErrExpired      = errors.New("ticket expired")
)

// Sign returns the ticket t signed with key (TunnelTicketKey).
func Sign(key ed25519.PrivateKey, t Ticket) (string, error) {
	t.Expires = t.ExpiresAt.Unix()
	body, err := json.Marshal(t)
	if err != nil {
		return "", fmt.Errorf("sign ticket: %w", err)
	}
	enc := base64.RawURLEncoding
	sig := ed25519.Sign(key, append([]byte(signingDomain), body...))
	return TicketPrefix + enc.EncodeToString(body) + "." + enc.EncodeToString(sig), nil
}

// Verify checks that s is a ticket signed with the private key of pub and
// unexpired at now, and returns what it grants. Errors: ErrMalformed,
// ErrBadSignature, ErrExpired (wrapped, with the expiry).
func Verify(pub ed25519.PublicKey, s string, now time.Time) (Ticket, error) {
	t, body, sig, err := parse(s)
	if err != nil {
		return Ticket{}, err
	}
	if !ed25519.Verify(pub, append([]byte(signingDomain), body...), sig) {
		return Ticket{}, ErrBadSignature
	}
	if !now.Before(t.ExpiresAt) {
		return Ticket{}, fmt.Errorf("%w at %s", ErrExpired, t.ExpiresAt.UTC().Format(time.RFC3339))
	}
	return t, nil
}

// parse splits and decodes a ticket without checking its signature.
func parse(s string) (Ticket, []byte, []byte, error) {
	rest, ok := strings.CutPrefix(s, TicketPrefix)
	if !ok || len(s) > maxTicketLen {
		return Ticket{}, nil, nil, ErrMalformed
	}
	b64body, b64sig, ok := strings.Cut(rest, ".")
	if !ok {
		return Ticket{}, nil, nil, ErrMalformed
	}
	enc := base64.RawURLEncoding
	body, err := enc.DecodeString(b64body)
	if err != nil {
		return Ticket{}, nil, nil, ErrMalformed
	}
	sig, err := enc.DecodeString(b64sig)
	if err != nil || len(sig) != ed25519.SignatureSize {
		return Ticket{}, nil, nil, ErrMalformed
	}
	var t Ticket
	if err := json.Unmarshal(body, &t); err != nil || t.ID == "" || t.NodeID == "" || t.Expires == 0 ||
		(t.Purpose != PurposeShell && t.Purpose != PurposeSSH) {
		return Ticket{}, nil, nil, ErrMalformed
	}
	t.ExpiresAt = time.Unix(t.Expires, 0).UTC()
	return t, body, sig, nil
}
