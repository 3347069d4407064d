package api_test

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/rsa"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/sshca"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/pkg/store/storetest"
	"github.com/better-compute/better-compute/pkg/tunnel"
	"github.com/better-compute/better-compute/services/api/api"
)

// testSSHKey is a user's public key in authorized_keys format.
var testSSHKey = func() string {
	pub, _, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		panic(err)
	}
	k, err := ssh.NewPublicKey(pub)
	if err != nil {
		panic(err)
	}
	return sshca.MarshalPublicKey(k) + " user@laptop"
}()

// sandbox is a pool of acme's offered to the other tenant, with an adopted
// node of it and an active reservation of the other tenant's on that node:
// a tenant reaching the sandbox of its reservation on another tenant's
// machine.
type sandbox struct {
	pool, node, reservation string
}

// newSandbox makes a sandbox whose reservation ends at end (zero: in an
// hour), in state (zero: active), on a node whose live session is on
// gateway gw ("": none).
func (f *fixture) newSandbox(t *testing.T, end time.Time, state, gw string) sandbox {
	t.Helper()
	pool := f.newPool(t)
	storetest.Offer(t, f.db, &storetest.OfferOpts{PoolID: pool, TenantID: f.other, GPUQuota: 8})
	opts := storetest.NodeOpts{State: store.NodeAdopted}
	if gw != "" {
		opts.GatewayID, opts.SessionID, opts.Reachable = gw, "ses_"+gw, true
	}
	node := f.node(t, pool, 1, "H100", opts)
	now := f.db.Now()
	if end.IsZero() {
		end = now.Add(time.Hour)
	}
	if state == "" {
		state = store.ReservationActive
	}
	r := storetest.Reservation(t, f.db, &storetest.ReservationOpts{TenantID: f.other, PoolID: pool, NodeID: node,
		DeviceIndexes: []int32{0}, StartAt: now.Add(-time.Minute), EndAt: end, State: state, PlacedAt: now, ActiveAt: now})
	return sandbox{pool: pool, node: node, reservation: r.ID}
}

func createTicket(t *testing.T, c clients, req *computev1.CreateTicketRequest) (*computev1.CreateTicketResponse, error) {
	t.Helper()
	res, err := c.tunnels.CreateTicket(t.Context(), connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

func issueCert(t *testing.T, c clients, req *computev1.IssueSshCertificateRequest) (*computev1.IssueSshCertificateResponse, error) {
	t.Helper()
	res, err := c.tunnels.IssueSshCertificate(t.Context(), connect.NewRequest(req))
	if err != nil {
		return nil, err
	}
	return res.Msg, nil
}

// lastAudit returns the newest audit row.
func (f *fixture) lastAudit(t *testing.T) store.AuditEntry {
	t.Helper()
	entries, err := store.ListAudit(t.Context(), f.db.Pool, store.AuditFilter{Scope: store.AllTenants, Limit: 1})
	require.NoError(t, err)
	require.Len(t, entries, 1)
	return entries[0]
}

// ticketKey returns the fixture's tunnel-ticket key.
func (f *fixture) ticketKey(t *testing.T) ed25519.PrivateKey {
	t.Helper()
	key, err := pki.LoadSigningKey(filepath.Join(f.pkiDir, pki.TunnelTicketKey))
	require.NoError(t, err)
	return key
}

func TestCreateTicket(t *testing.T) {
	t.Parallel()
	f := setup(t)
	ctx := t.Context()
	admin := f.as(f.tokens["acme-admin"])
	node := f.node(t, f.acmePool, 1, "H100", adopted)

	before := f.db.Now()
	res, err := createTicket(t, admin, &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
	require.NoError(t, err)
	require.NoError(t, ids.Check(ids.Ticket, res.TicketId))
	require.Equal(t, api.TunnelsPath+res.Ticket, res.Path)
	require.Equal(t, "/api/compute/tunnels/"+res.Ticket, res.Path)
	tk, err := tunnel.Verify(f.ticketKey(t).Public().(ed25519.PublicKey), res.Ticket, f.db.Now())
	require.NoError(t, err)
	require.Equal(t, res.TicketId, tk.ID)
	require.Equal(t, node, tk.NodeID)
	require.Equal(t, "shell", tk.Purpose)
	require.Equal(t, f.acme, tk.TenantID)
	require.Equal(t, tokenID(t, f.db, f.tokens["acme-admin"]), tk.TokenID)
	require.Empty(t, tk.ReservationID)
	require.True(t, tk.ExpiresAt.Equal(res.ExpiresAt.AsTime()))
	require.WithinDuration(t, before.Add(tunnel.TicketTTL), tk.ExpiresAt, 2*time.Second)
	row, err := store.GetTunnelTicket(ctx, f.db.Pool, res.TicketId)
	require.NoError(t, err)
	require.Equal(t, node, row.NodeID)
	require.Equal(t, tk.TokenID, row.TokenID)
	require.True(t, row.ExpiresAt.Equal(tk.ExpiresAt), "the row expires with the ticket")
	require.Nil(t, row.ConsumedAt)
	e := f.lastAudit(t)
	require.Equal(t, computev1connect.TunnelServiceCreateTicketProcedure, e.Procedure)
	require.Equal(t, node, e.Target)
	require.Equal(t, "ok", e.Outcome)
	require.Equal(t, "shell ticket "+res.TicketId+" (shell), expires "+tk.ExpiresAt.UTC().Format(time.RFC3339), e.Detail)

	res, err = createTicket(t, f.as(f.tokens["root"]), &computev1.CreateTicketRequest{NodeId: node, Purpose: "ssh"})
	require.NoError(t, err, "root-admin reaches every node")
	require.Contains(t, f.lastAudit(t).Detail, "ssh ticket "+res.TicketId+" (break-glass)")

	sb := f.newSandbox(t, time.Time{}, "", "")
	otherMember := f.as(f.tokens["other-member"])
	res, err = createTicket(t, otherMember, &computev1.CreateTicketRequest{NodeId: sb.node, Purpose: "ssh",
		ReservationId: sb.reservation})
	require.NoError(t, err, "the sandbox of its reservation, on a node of another tenant's pool")
	tk, err = tunnel.Verify(f.ticketKey(t).Public().(ed25519.PublicKey), res.Ticket, f.db.Now())
	require.NoError(t, err)
	require.Equal(t, sb.reservation, tk.ReservationID)
	require.Equal(t, f.other, tk.TenantID)
	require.Contains(t, f.lastAudit(t).Detail, "(sandbox of "+sb.reservation+")")

	revoked := f.node(t, f.acmePool, 1, "H100", storetest.NodeOpts{State: store.NodeAdopted, RevokedAt: f.db.Now(),
		RevokeReason: "stolen"})
	joining := f.node(t, f.acmePool, 0, "", storetest.NodeOpts{})
	pending := f.newSandbox(t, time.Time{}, store.ReservationPending, "")
	ended := f.newSandbox(t, f.db.Now().Add(-time.Second), "", "")
	otherNode := f.node(t, f.otherPool, 1, "H100", adopted)
	for _, tc := range []struct {
		name string
		who  string
		req  *computev1.CreateTicketRequest
		code connect.Code
		msg  string
	}{
		{"a member's shell", "acme-member", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"},
			connect.CodePermissionDenied, "role tenant-member may not open a shell or break-glass SSH on a node (needs nodes.access); " +
				"set reservation_id for the sandbox of a reservation"},
		{"a member's break-glass", "acme-member", &computev1.CreateTicketRequest{NodeId: node, Purpose: "ssh"},
			connect.CodePermissionDenied, "(needs nodes.access)"},
		{"another tenant's node", "other-admin", &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"},
			connect.CodeNotFound, "node " + node + " not found"},
		{"a missing node", "acme-admin", &computev1.CreateTicketRequest{NodeId: "node_missing", Purpose: "shell"},
			connect.CodeNotFound, "node node_missing not found"},
		{"a revoked node", "acme-admin", &computev1.CreateTicketRequest{NodeId: revoked, Purpose: "shell"},
			connect.CodeFailedPrecondition, "node_id: node " + revoked + " is revoked: stolen"},
		{"a joining node", "acme-admin", &computev1.CreateTicketRequest{NodeId: joining, Purpose: "shell"},
			connect.CodeFailedPrecondition, "node_id: node " + joining + " is not adopted (it is joining)"},
		{"a shell in a sandbox", "other-member", &computev1.CreateTicketRequest{NodeId: sb.node, Purpose: "shell",
			ReservationId: sb.reservation}, connect.CodeInvalidArgument, "reservation_id: only an ssh tunnel reaches a reservation's sandbox"},
		{"another tenant's reservation", "acme-member", &computev1.CreateTicketRequest{NodeId: sb.node, Purpose: "ssh",
			ReservationId: sb.reservation}, connect.CodeNotFound, "reservation_id: reservation " + sb.reservation + " not found"},
		{"a pending reservation", "other-member", &computev1.CreateTicketRequest{NodeId: pending.node, Purpose: "ssh",
			ReservationId: pending.reservation}, connect.CodeFailedPrecondition,
			"reservation_id: reservation " + pending.reservation + " is pending, not active"},
		{"a reservation past its end", "other-member", &computev1.CreateTicketRequest{NodeId: ended.node, Purpose: "ssh",
			ReservationId: ended.reservation}, connect.CodeFailedPrecondition,
			"reservation_id: reservation " + ended.reservation + " ended at"},
		{"its reservation on another node it sees", "other-member", &computev1.CreateTicketRequest{NodeId: otherNode,
			Purpose: "ssh", ReservationId: sb.reservation}, connect.CodeFailedPrecondition,
			"reservation_id: reservation " + sb.reservation + " is not on node " + otherNode},
		{"its reservation on a node it does not see", "other-member", &computev1.CreateTicketRequest{NodeId: node,
			Purpose: "ssh", ReservationId: sb.reservation}, connect.CodeNotFound, "node " + node + " not found"},
		{"a viewer's sandbox", "other-viewer", &computev1.CreateTicketRequest{NodeId: sb.node, Purpose: "ssh",
			ReservationId: sb.reservation}, connect.CodePermissionDenied,
			"role viewer may not call CreateTicket (needs reservations.write)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := createTicket(t, f.as(f.tokens[tc.who]), tc.req)
			requireCode(t, err, tc.code, tc.msg)
			e := f.lastAudit(t)
			require.Equal(t, computev1connect.TunnelServiceCreateTicketProcedure, e.Procedure)
			require.Equal(t, tc.code.String(), e.Outcome)
			require.Equal(t, errMessage(t, err), e.Detail)
		})
	}
	// Without a PKI directory, tunnels are not configured.
	bare := f.replica(t, api.Config{}, nil)
	_, err = createTicket(t, bare.as(f.tokens["acme-admin"]), &computev1.CreateTicketRequest{NodeId: node, Purpose: "shell"})
	requireCode(t, err, connect.CodeFailedPrecondition, "tunnels are not configured: the API has no PKI directory (BETTER_COMPUTE_PKI_DIR)")
	_, err = issueCert(t, bare.as(f.tokens["acme-admin"]), &computev1.IssueSshCertificateRequest{NodeId: node,
		PublicKey: testSSHKey})
	requireCode(t, err, connect.CodeFailedPrecondition, "tunnels are not configured")
}

// parseCert parses a certificate in authorized_keys format.
func parseCert(t *testing.T, text string) *ssh.Certificate {
	t.Helper()
	k, _, _, _, err := ssh.ParseAuthorizedKey([]byte(text))
	require.NoError(t, err)
	cert, ok := k.(*ssh.Certificate)
	require.True(t, ok, "a certificate: %T", k)
	return cert
}

// authority returns the fixture's SSH user CA name, as a node trusts it.
func (f *fixture) authority(t *testing.T, name string) sshca.Authority {
	t.Helper()
	ca, err := sshca.LoadCA(f.pkiDir, name)
	require.NoError(t, err)
	as, err := sshca.Authorities([]*gatewayv1.SshUserCa{ca.UserCA()})
	require.NoError(t, err)
	return as[0]
}

func TestIssueSshCertificate(t *testing.T) {
	t.Parallel()
	f := setup(t)
	admin := f.as(f.tokens["acme-admin"])
	node := f.node(t, f.acmePool, 1, "H100", adopted)
	adminTok := tokenID(t, f.db, f.tokens["acme-admin"])

	// Break-glass: root on the node, 15 minutes by default.
	res, err := issueCert(t, admin, &computev1.IssueSshCertificateRequest{NodeId: node, PublicKey: testSSHKey})
	require.NoError(t, err)
	cert := parseCert(t, res.Certificate)
	require.Equal(t, sshca.BreakGlass, res.Ca)
	require.Equal(t, []string{"root"}, cert.ValidPrincipals)
	require.Equal(t, []string{"root"}, res.Principals)
	require.Equal(t, adminTok+" for "+node, cert.KeyId)
	require.Equal(t, cert.KeyId, res.KeyId)
	require.Equal(t, cert.Serial, res.Serial)
	require.Equal(t, map[string]string{sshca.NodeOption: node}, cert.CriticalOptions)
	require.EqualValues(t, ssh.UserCert, cert.CertType)
	require.Equal(t, int64(cert.ValidBefore), res.ValidBefore.AsTime().Unix())
	require.Equal(t, int64(cert.ValidAfter), res.ValidAfter.AsTime().Unix())
	require.WithinDuration(t, f.db.Now().Add(sshca.DefaultTTL), res.ValidBefore.AsTime(), 2*time.Second)
	require.True(t, strings.HasPrefix(res.Certificate, "ssh-ed25519-cert-v01@openssh.com "), res.Certificate)
	userKey, err := sshca.ParseUserKey(testSSHKey)
	require.NoError(t, err)
	require.Equal(t, userKey.Marshal(), cert.Key.Marshal())
	// The node's rule accepts it: for root, on this node only.
	login := sshca.Login{User: "root", Key: cert, NodeID: node, Authorities: []sshca.Authority{f.authority(t, sshca.BreakGlass)},
		Now: f.db.Now()}
	ca, err := sshca.Authorize(login)
	require.NoError(t, err)
	require.Equal(t, sshca.BreakGlass, ca)
	login.NodeID = "node_other"
	_, err = sshca.Authorize(login)
	require.ErrorContains(t, err, "bound to node "+node)
	e := f.lastAudit(t)
	require.Equal(t, computev1connect.TunnelServiceIssueSshCertificateProcedure, e.Procedure)
	require.Equal(t, node, e.Target)
	require.Equal(t, "ok", e.Outcome)
	require.Equal(t, "break-glass certificate serial "+u64(res.Serial)+", key id \""+adminTok+" for "+node+
		"\", principals root, valid "+res.ValidAfter.AsTime().Format(time.RFC3339)+" to "+
		res.ValidBefore.AsTime().Format(time.RFC3339), e.Detail)

	res, err = issueCert(t, admin, &computev1.IssueSshCertificateRequest{NodeId: node, PublicKey: testSSHKey,
		Ttl: durationpb.New(time.Hour)})
	require.NoError(t, err)
	require.WithinDuration(t, f.db.Now().Add(time.Hour), res.ValidBefore.AsTime(), 2*time.Second)

	// Sandbox: the reservation's principal, no later than its end.
	end := f.db.Now().Add(5 * time.Minute).Truncate(time.Second)
	sb := f.newSandbox(t, end, "", "")
	memberTok := tokenID(t, f.db, f.tokens["other-member"])
	res, err = issueCert(t, f.as(f.tokens["other-member"]), &computev1.IssueSshCertificateRequest{NodeId: sb.node,
		PublicKey: testSSHKey, Ttl: durationpb.New(time.Hour), ReservationId: sb.reservation})
	require.NoError(t, err)
	cert = parseCert(t, res.Certificate)
	require.Equal(t, sshca.Sandbox, res.Ca)
	require.Equal(t, []string{sb.reservation}, cert.ValidPrincipals)
	require.Equal(t, memberTok+" for "+sb.node+", reservation "+sb.reservation, cert.KeyId)
	require.Equal(t, sb.node, cert.CriticalOptions[sshca.NodeOption])
	require.Equal(t, end.Unix(), int64(cert.ValidBefore), "clipped to the reservation's end")
	ca, err = sshca.Authorize(sshca.Login{User: sb.reservation, Key: cert, NodeID: sb.node,
		Authorities: []sshca.Authority{f.authority(t, sshca.Sandbox)}, Reservations: func(id string) bool { return id == sb.reservation },
		Now: f.db.Now()})
	require.NoError(t, err)
	require.Equal(t, sshca.Sandbox, ca)
	e = f.lastAudit(t)
	require.Contains(t, e.Detail, "sandbox certificate serial "+u64(res.Serial))
	require.Contains(t, e.Detail, "principals "+sb.reservation)
	require.Equal(t, f.other, e.TenantID)

	for _, tc := range []struct {
		name string
		who  string
		req  *computev1.IssueSshCertificateRequest
		code connect.Code
		msg  string
	}{
		{"not a key", "acme-admin", &computev1.IssueSshCertificateRequest{NodeId: node, PublicKey: "hello"},
			connect.CodeInvalidArgument, "public_key: not an SSH public key"},
		{"a certificate", "acme-admin", &computev1.IssueSshCertificateRequest{NodeId: node, PublicKey: res.Certificate},
			connect.CodeInvalidArgument, "public_key: a certificate, not a public key"},
		{"two keys", "acme-admin", &computev1.IssueSshCertificateRequest{NodeId: node, PublicKey: testSSHKey + "\n" + testSSHKey},
			connect.CodeInvalidArgument, "public_key: more than one SSH public key"},
		{"a short RSA key", "acme-admin", &computev1.IssueSshCertificateRequest{NodeId: node, PublicKey: rsa1024Key(t)},
			connect.CodeInvalidArgument, "public_key: an RSA key of 1024 bits: at least 2048 are needed"},
		{"too long", "acme-admin", &computev1.IssueSshCertificateRequest{NodeId: node, PublicKey: testSSHKey,
			Ttl: durationpb.New(2 * time.Hour)}, connect.CodeInvalidArgument, "ttl"},
		{"under a second", "acme-admin", &computev1.IssueSshCertificateRequest{NodeId: node, PublicKey: testSSHKey,
			Ttl: durationpb.New(time.Millisecond)}, connect.CodeInvalidArgument, "ttl: at least 1s"},
		{"a member's break-glass", "acme-member", &computev1.IssueSshCertificateRequest{NodeId: node, PublicKey: testSSHKey},
			connect.CodePermissionDenied, "(needs nodes.access)"},
		{"another tenant's node", "other-admin", &computev1.IssueSshCertificateRequest{NodeId: node, PublicKey: testSSHKey},
			connect.CodeNotFound, "node " + node + " not found"},
		{"another tenant's reservation", "acme-admin", &computev1.IssueSshCertificateRequest{NodeId: sb.node,
			PublicKey: testSSHKey, ReservationId: sb.reservation}, connect.CodeNotFound,
			"reservation_id: reservation " + sb.reservation + " not found"},
		{"a viewer's sandbox", "other-viewer", &computev1.IssueSshCertificateRequest{NodeId: sb.node,
			PublicKey: testSSHKey, ReservationId: sb.reservation}, connect.CodePermissionDenied,
			"role viewer may not call IssueSshCertificate (needs reservations.write)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := issueCert(t, f.as(f.tokens[tc.who]), tc.req)
			requireCode(t, err, tc.code, tc.msg)
			e := f.lastAudit(t)
			require.Equal(t, computev1connect.TunnelServiceIssueSshCertificateProcedure, e.Procedure)
			require.Equal(t, tc.code.String(), e.Outcome)
		})
	}
}

func u64(n uint64) string { return strconv.FormatUint(n, 10) }

// rsa1024Key returns an RSA public key of 1024 bits in authorized_keys
// format: too short for a certificate.
func rsa1024Key(t *testing.T) string {
	t.Helper()
	k, err := rsa.GenerateKey(rand.Reader, 1024)
	require.NoError(t, err)
	pub, err := ssh.NewPublicKey(&k.PublicKey)
	require.NoError(t, err)
	return sshca.MarshalPublicKey(pub)
}
