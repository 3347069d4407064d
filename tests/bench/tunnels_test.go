package bench

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/coder/websocket"
	"github.com/stretchr/testify/require"
	"golang.org/x/crypto/ssh"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/iam"
	"github.com/better-compute/better-compute/pkg/sshca"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// BenchmarkTunnels runs the real services in process (devstack) with
// BETTER_COMPUTE_BENCH_TUNNEL_MACHINES (default 100) simulated machines and
// drives tunnels as the CLI does (an exec ticket, then the WebSocket), and
// prints:
//
//   - open latency: 200 shell tunnels opened one after another, from the
//     ticket's request to the first byte of the shell's prompt. Target p99
//     < 300 ms.
//   - throughput: BETTER_COMPUTE_BENCH_TUNNEL_MIB (default 256) MiB through
//     one ssh tunnel (an SSH session running cat on the machine) and back,
//     in MiB/s each way. Target ≥ 50 MiB/s.
//   - 100 concurrent consoles, one per machine: the time to open them all,
//     then the round trip of a command typed in each at once (p50, p99).
func BenchmarkTunnels(b *testing.B) {
	for range b.N {
		f := startFleet(b, fleetOptions{machines: envInt("BETTER_COMPUTE_BENCH_TUNNEL_MACHINES", 100), tickets: 10_000})
		f.startMachines(b, nil)
		f.waitAdopted(b)
		nodes := f.nodeIDs(b)
		wall := clock.New()
		ctx := b.Context()

		// Open latency.
		const opens = 200
		lat := make([]time.Duration, 0, opens)
		for i := range opens {
			began := wall.Now()
			ws := f.openTunnel(b, f.rootToken, nodes[i%len(nodes)], tunnel.PurposeShell)
			firstData(b, ws)
			lat = append(lat, clock.Since(wall, began))
			closeTunnel(ws)
		}
		p := percentiles(lat, 0.5, 0.99)
		b.ReportMetric(ms(p[0]), "open-p50-ms")
		b.ReportMetric(ms(p[1]), "open-p99-ms")
		b.Logf("tunnel open (ticket → first byte of the prompt), %d in a row: p50 %s, p99 %s (target p99 < 300 ms)", opens,
			p[0].Round(100*time.Microsecond), p[1].Round(100*time.Microsecond))

		// Throughput through one ssh tunnel.
		mib := envInt("BETTER_COMPUTE_BENCH_TUNNEL_MIB", 256)
		rate := f.sshThroughput(b, nodes[0], mib)
		b.ReportMetric(rate, "MiB/s")
		b.Logf("one ssh tunnel: %d MiB to cat on the machine and back at %.1f MiB/s each way (target ≥ 50 MiB/s)", mib, rate)

		// 100 concurrent consoles: a token per 8 (the default limit per
		// token), one machine each.
		consoles := min(100, len(nodes))
		tokens := make([]string, (consoles+7)/8)
		for i := range tokens {
			secret, _, err := iam.MintAPIToken(ctx, f.db.Pool, f.db.Now(), f.tenantID, fmt.Sprintf("bench-%d", i),
				iam.RoleTenantAdmin, nil)
			require.NoError(b, err)
			tokens[i] = secret
		}
		began := wall.Now()
		wss := make([]*websocket.Conn, consoles)
		var wg sync.WaitGroup
		for i := range consoles {
			wg.Go(func() {
				wss[i] = f.openTunnel(b, tokens[i/8], nodes[i], tunnel.PurposeShell)
				firstData(b, wss[i])
			})
		}
		wg.Wait()
		opened := clock.Since(wall, began)
		rtt := make([]time.Duration, consoles)
		for i, ws := range wss {
			wg.Go(func() {
				began := wall.Now()
				send(b, ws, &tunnelv1.Frame{Frame: &tunnelv1.Frame_Data{Data: []byte("hello\r")}})
				var seen []byte
				for !bytes.Contains(seen, []byte("hello\r\n")) {
					seen = append(seen, firstData(b, ws)...)
				}
				rtt[i] = clock.Since(wall, began)
			})
		}
		wg.Wait()
		for _, ws := range wss {
			closeTunnel(ws)
		}
		p = percentiles(rtt, 0.5, 0.99)
		b.ReportMetric(ms(opened), "open-100-ms")
		b.ReportMetric(ms(p[1]), "console-rtt-p99-ms")
		b.Logf("%d concurrent consoles: all open in %s; a line typed in each at once echoed: p50 %s, p99 %s", consoles,
			opened.Round(time.Millisecond), p[0].Round(100*time.Microsecond), p[1].Round(100*time.Microsecond))
	}
}

// openTunnel asks for a ticket to node as token and opens its WebSocket.
func (f *fleet) openTunnel(b *testing.B, token, node, purpose string) *websocket.Conn {
	b.Helper()
	ctx := b.Context()
	hc := &http.Client{Transport: bearer{token: token, next: http.DefaultTransport}}
	tickets := computev1connect.NewTunnelServiceClient(hc, f.apiURL+"/api/compute")
	res, err := tickets.CreateTicket(ctx, connect.NewRequest(&computev1.CreateTicketRequest{NodeId: node, Purpose: purpose}))
	require.NoError(b, err)
	u := f.apiURL + res.Msg.GetPath() + "?" + url.Values{"node": {node}, "rows": {"24"}, "cols": {"80"}}.Encode()
	ws, resp, err := websocket.Dial(ctx, u, nil)
	if resp != nil && resp.Body != nil {
		resp.Body.Close()
	}
	require.NoError(b, err)
	ws.SetReadLimit(128 << 10)
	return ws
}

// firstData returns the data of the next data frame of ws.
func firstData(b *testing.B, ws *websocket.Conn) []byte {
	b.Helper()
	for {
		_, msg, err := ws.Read(b.Context())
		require.NoError(b, err)
		var fr tunnelv1.Frame
		require.NoError(b, proto.Unmarshal(msg, &fr))
		if d := fr.GetData(); d != nil {
			return d
		}
		require.Nil(b, fr.GetClose(), "the tunnel closed: %s", fr.GetClose().GetReason())
	}
}

func send(b *testing.B, ws *websocket.Conn, fr *tunnelv1.Frame) {
	b.Helper()
	msg, err := proto.Marshal(fr)
	require.NoError(b, err)
	require.NoError(b, ws.Write(b.Context(), websocket.MessageBinary, msg))
}

// closeTunnel detaches, as the CLI does.
func closeTunnel(ws *websocket.Conn) {
	msg, _ := proto.Marshal(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: "detached"}}})
	_ = ws.Write(context.Background(), websocket.MessageBinary, msg)
	_ = ws.Close(websocket.StatusNormalClosure, "")
}

// wsFrames is tunnel.Frames over a WebSocket of the API's tunnel endpoint.
type wsFrames struct {
	ctx context.Context
	ws  *websocket.Conn
}

func (w wsFrames) Send(fr *tunnelv1.Frame) error {
	msg, err := proto.Marshal(fr)
	if err != nil {
		return err
	}
	return w.ws.Write(w.ctx, websocket.MessageBinary, msg)
}

func (w wsFrames) Receive() (*tunnelv1.Frame, error) {
	_, msg, err := w.ws.Read(w.ctx)
	if err != nil {
		return nil, io.EOF
	}
	fr := &tunnelv1.Frame{}
	return fr, proto.Unmarshal(msg, fr)
}

func (w wsFrames) CloseSend() error { return nil }

// sshThroughput logs in to node's SSH server through an ssh tunnel with a
// break-glass certificate, runs cat, and returns the MiB/s of mib MiB sent
// and read back.
func (f *fleet) sshThroughput(b *testing.B, node string, mib int) float64 {
	b.Helper()
	ctx := b.Context()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(b, err)
	sshPub, err := ssh.NewPublicKey(pub)
	require.NoError(b, err)
	hc := &http.Client{Transport: bearer{token: f.rootToken, next: http.DefaultTransport}}
	tickets := computev1connect.NewTunnelServiceClient(hc, f.apiURL+"/api/compute")
	cres, err := tickets.IssueSshCertificate(ctx, connect.NewRequest(&computev1.IssueSshCertificateRequest{NodeId: node,
		PublicKey: sshca.MarshalPublicKey(sshPub), Ttl: durationpb.New(time.Hour)}))
	require.NoError(b, err)
	certKey, _, _, _, err := ssh.ParseAuthorizedKey([]byte(cres.Msg.GetCertificate()))
	require.NoError(b, err)
	signer, err := ssh.NewSignerFromKey(priv)
	require.NoError(b, err)
	certSigner, err := ssh.NewCertSigner(certKey.(*ssh.Certificate), signer)
	require.NoError(b, err)

	ws := f.openTunnel(b, f.rootToken, node, tunnel.PurposeSSH)
	defer closeTunnel(ws)
	conn := tunnel.NewConn(wsFrames{ctx: ctx, ws: ws})
	c, chans, reqs, err := ssh.NewClientConn(conn, node, &ssh.ClientConfig{User: "root",
		Auth: []ssh.AuthMethod{ssh.PublicKeys(certSigner)}, HostKeyCallback: ssh.InsecureIgnoreHostKey()}) //nolint:gosec // a benchmark's own node
	require.NoError(b, err)
	client := ssh.NewClient(c, chans, reqs)
	defer client.Close()
	session, err := client.NewSession()
	require.NoError(b, err)
	defer session.Close()
	stdin, err := session.StdinPipe()
	require.NoError(b, err)
	stdout, err := session.StdoutPipe()
	require.NoError(b, err)
	require.NoError(b, session.Start("cat"))

	total := int64(mib) << 20
	chunk := make([]byte, 256<<10)
	_, _ = rand.Read(chunk)
	wall := clock.New()
	began := wall.Now()
	errc := make(chan error, 1)
	go func() {
		for sent := int64(0); sent < total; sent += int64(len(chunk)) {
			if _, err := stdin.Write(chunk); err != nil {
				errc <- err
				return
			}
		}
		errc <- stdin.Close()
	}()
	n, err := io.Copy(io.Discard, stdout)
	require.NoError(b, err)
	require.NoError(b, <-errc)
	require.Equal(b, total, n, "every byte came back")
	require.NoError(b, session.Wait())
	return float64(total) / (1 << 20) / clock.Since(wall, began).Seconds()
}
