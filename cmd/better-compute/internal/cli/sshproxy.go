package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"strings"
	"sync"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// sshConfigExample is the ~/.ssh/config block of ssh-proxy's help.
const sshConfigExample = `    # The sandbox of a reservation: ssh res_…@node_…
    Match host node_* user res_*
        ProxyCommand better-compute ssh-proxy --node %h --reservation %r
    # Break-glass root: ssh node_…
    Host node_*
        User root
        ProxyCommand better-compute ssh-proxy --node %h
        IdentityFile ~/.ssh/id_ed25519
        CertificateFile ~/.ssh/id_ed25519-cert.pub
`

func (a *app) sshProxyCmd() *cobra.Command {
	var node, reservation string
	c := &cobra.Command{
		Use:   "ssh-proxy (--node NODE_ID | --reservation RES_ID)",
		Short: "Connect standard input and output to a node's SSH server (OpenSSH's ProxyCommand)",
		Long: "ssh-proxy connects its standard input and output to the SSH server of a node's machine through a\n" +
			"tunnel, for OpenSSH's ProxyCommand: it asks the API for an exec ticket (TunnelService.CreateTicket,\n" +
			"purpose ssh; with --reservation, for the sandbox of that active reservation) and opens the tunnel as\n" +
			"a WebSocket at /api/compute/tunnels/<ticket>. Then it copies bytes both ways, as they are, and never\n" +
			"writes anything else on standard output. It exits 0 when the stream ends cleanly or ssh closes its\n" +
			"side, and 255 when the tunnel could not be opened or was closed with a reason, saying why on\n" +
			"standard error (\"ssh-proxy: <reason>\"). --node takes the node id as ssh's %h gives it: ssh\n" +
			"lowercases host names, and ssh-proxy restores the id's case.\n\n" +
			"The SSH server takes a certificate from ssh-cert, valid on that one node. In ~/.ssh/config:\n\n" +
			sshConfigExample + "\n" +
			"and before logging in (a certificate lasts at most an hour):\n\n" +
			"    better-compute ssh-cert --node node_… --public-key ~/.ssh/id_ed25519.pub\n" +
			"    ssh node_…\n\n" +
			"or, for a sandbox, ssh-cert with --reservation res_… and ssh res_…@node_…. ProxyCommand runs in\n" +
			"ssh's environment: BETTER_COMPUTE_URL, BETTER_COMPUTE_TOKEN (and BETTER_COMPUTE_TENANT) must be set\n" +
			"where ssh runs. Break-glass SSH needs a tenant-admin token of the node's tenant or a root-admin\n" +
			"token; a sandbox, a tenant-member or stronger token of the tenant holding the reservation (not a\n" +
			"viewer's).",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&node, "node", "", "node id, in any case (required without --reservation; with it, default: its node)")
	c.Flags().StringVar(&reservation, "reservation", "", "reservation id: connect to its sandbox on the node")
	_ = c.RegisterFlagCompletionFunc("reservation", a.completeReservationIDs(true))
	_ = c.RegisterFlagCompletionFunc("node", a.completeNodeIDs)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		if node == "" && reservation == "" {
			return errNodeOrReservation
		}
		req := &computev1.CreateTicketRequest{NodeId: canonicalID(ids.Node, node), Purpose: tunnel.PurposeSSH}
		if reservation != "" {
			req.ReservationId = canonicalID(ids.Reservation, reservation)
			cl, err := a.clients()
			if err != nil {
				return err
			}
			if req.NodeId, err = reservationNode(cmd.Context(), cl, req.ReservationId, req.NodeId); err != nil {
				fmt.Fprintf(a.env.Stderr, "ssh-proxy: %s\n", cell(strings.TrimPrefix(FormatError(err), "error: ")))
				return exitError{tunnelFailed}
			}
		}
		return a.sshProxy(cmd.Context(), req)
	}
	return c
}

// errNodeOrReservation refuses ssh-cert and ssh-proxy given neither a node
// nor a reservation.
var errNodeOrReservation = errors.New("required flag(s) \"node\" not set: give --node, or --reservation (its node is the default)")

// reservationNode returns the node of reservation id (NodeId of
// GetReservation), or node when it is set and is that node. Errors: the
// API's (NotFound), a reservation not placed on a node yet, or a node
// other than the reservation's, naming both.
func reservationNode(ctx context.Context, cl *apiClients, id, node string) (string, error) {
	res, err := cl.res.GetReservation(ctx, connect.NewRequest(&computev1.GetReservationRequest{ReservationId: id}))
	if err != nil {
		return "", err
	}
	r := res.Msg.GetReservation()
	switch {
	case r.GetNodeId() == "":
		return "", fmt.Errorf("reservation %s is %s and on no node yet: its sandbox opens once it is active", id, r.GetState())
	case node != "" && node != r.GetNodeId():
		return "", fmt.Errorf("--node %s is not the node of reservation %s (%s): drop --node, or give --node %s", node, id,
			r.GetNodeId(), r.GetNodeId())
	}
	return r.GetNodeId(), nil
}

// sshProxy copies stdin to the tunnel req grants and the tunnel to stdout.
func (a *app) sshProxy(ctx context.Context, req *computev1.CreateTicketRequest) error {
	fail := func(msg string) error {
		fmt.Fprintf(a.env.Stderr, "ssh-proxy: %s\n", cell(msg))
		return exitError{tunnelFailed}
	}
	t, err := a.openTunnel(ctx, req, url.Values{"node": {req.NodeId}})
	if err != nil {
		return fail(strings.TrimPrefix(FormatError(err), "error: "))
	}
	defer t.close()
	conn := tunnel.NewConn(t)
	in := a.env.Stdin
	if in == nil {
		in = strings.NewReader("")
	}

	var wg sync.WaitGroup
	received := make(chan error, 1)
	wg.Go(func() {
		_, err := io.Copy(a.env.Stdout, conn)
		received <- err
	})
	// Not waited for: a read of stdin cannot be interrupted.
	sent := make(chan error, 1)
	go func() { sent <- copyInput(conn, in) }()

	select {
	case err = <-received:
	case werr := <-sent:
		if werr != nil {
			// The tunnel failed under the write: the receiving side
			// says why.
			err = <-received
			break
		}
		// ssh closed its side: the connection is over.
		_ = conn.Close()
	case <-ctx.Done():
		// ssh ends its ProxyCommand with SIGHUP when it is done.
		_ = conn.Close()
	}
	t.close()
	wg.Wait()

	var closed *tunnel.ClosedError
	var lost *tunnelLostError
	switch {
	case errors.As(err, &closed):
		if closed.Reason == "" || closed.Reason == reasonClosed {
			return nil // the node's end closed normally
		}
		return fail(closed.Reason)
	case errors.As(err, &lost):
		return fail(lost.Error())
	}
	// The end of the stream, ssh's end of it, or stdout gone (ssh with
	// it): nothing to say.
	return nil
}

// copyInput writes what it reads from in to conn until in ends (nil, also
// on a read error: either way ssh is done with its side) or a write fails
// (that error).
func copyInput(conn *tunnel.Conn, in io.Reader) error {
	buf := make([]byte, tunnel.MaxChunk)
	for {
		n, err := in.Read(buf)
		if n > 0 {
			if _, werr := conn.Write(buf[:n]); werr != nil {
				return werr
			}
		}
		if err != nil {
			return nil
		}
	}
}
