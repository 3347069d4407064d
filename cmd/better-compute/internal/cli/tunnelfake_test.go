package cli_test

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/coder/websocket"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/sshca"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// The fake tunnel endpoint's token, node and the reason its shell's
// "close" command closes the tunnel with.
const (
	fakeToken       = "bct_tunnel-test"
	fakeTenant      = "ten_tunnel-test"
	fakeCloseReason = "the node was revoked"
)

// fakeTunnels is an API with TunnelService (tickets; certificates from real
// sshca CAs), NodeService.ListNodes (for completion) and the tunnels'
// WebSocket path, behind which a shell tunnel is an echo shell (size,
// exit, false, close, drop; any other line is echoed) and an ssh tunnel
// echoes its bytes. It records what clients sent.
type fakeTunnels struct {
	url  string
	node string
	// reservation is an active reservation on node; pending one on none.
	reservation, pending string
	clk                  clock.Clock
	cas                  map[string]*sshca.CA

	mu      sync.Mutex
	tickets map[string]*computev1.CreateTicketRequest // by ticket; deleted when used
	serial  int
	// refuse, when set, answers the upgrade with this status and text.
	refuse *fakeRefusal
	// opens are the upgrades: their query and headers.
	opens []fakeOpen
	// frames are the frames clients sent, in order.
	frames []*tunnelv1.Frame
	// ticketRequests are the CreateTicket requests.
	ticketRequests []*computev1.CreateTicketRequest
	// certRequests are the IssueSshCertificate requests.
	certRequests []*computev1.IssueSshCertificateRequest
	// kick closes the open ssh tunnels with a reason.
	kick chan string
}

type fakeRefusal struct {
	status int
	text   string
	// json sends text as the API does: {"code", "message"} with code
	// (writeHTTPError in services/api).
	json       string
	retryAfter string
}

type fakeOpen struct {
	ticket string
	query  url.Values
	header http.Header
}

func newFakeTunnels(t *testing.T) *fakeTunnels {
	t.Helper()
	f := &fakeTunnels{node: ids.New(ids.Node, clock.New().Now()), reservation: ids.New(ids.Reservation, clock.New().Now()),
		pending: ids.New(ids.Reservation, clock.New().Now()), clk: clock.New(), cas: map[string]*sshca.CA{},
		tickets: map[string]*computev1.CreateTicketRequest{}, kick: make(chan string, 1)}
	for _, name := range []string{sshca.BreakGlass, sshca.Sandbox} {
		_, key, err := ed25519.GenerateKey(rand.Reader)
		require.NoError(t, err)
		ca, err := sshca.NewCA(name, key)
		require.NoError(t, err)
		f.cas[name] = ca
	}
	mux := http.NewServeMux()
	path, h := computev1connect.NewTunnelServiceHandler(fakeTunnelService{f})
	mux.Handle("/api/compute"+path, http.StripPrefix("/api/compute", h))
	path, h = computev1connect.NewNodeServiceHandler(fakeNodeService{f: f})
	mux.Handle("/api/compute"+path, http.StripPrefix("/api/compute", h))
	path, h = computev1connect.NewReservationServiceHandler(fakeReservationService{f: f})
	mux.Handle("/api/compute"+path, http.StripPrefix("/api/compute", h))
	mux.HandleFunc("GET /api/compute/tunnels/{ticket}", f.serveTunnel)
	ts := httptest.NewServer(mux)
	t.Cleanup(ts.Close)
	f.url = ts.URL
	return f
}

// env is the CLI's environment for this endpoint.
func (f *fakeTunnels) env() map[string]string {
	return map[string]string{"BETTER_COMPUTE_URL": f.url, "BETTER_COMPUTE_TOKEN": fakeToken, "BETTER_COMPUTE_TENANT": fakeTenant}
}

func (f *fakeTunnels) setRefusal(r *fakeRefusal) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.refuse = r
}

// sent returns the frames clients sent so far.
func (f *fakeTunnels) sent() []*tunnelv1.Frame {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*tunnelv1.Frame(nil), f.frames...)
}

// closesSent returns the reasons of the Close frames clients sent.
func (f *fakeTunnels) closesSent() []string {
	var out []string
	for _, fr := range f.sent() {
		if c := fr.GetClose(); c != nil {
			out = append(out, c.GetReason())
		}
	}
	return out
}

// resizesSent returns the resizes clients sent, as "ROWSxCOLS".
func (f *fakeTunnels) resizesSent() []string {
	var out []string
	for _, fr := range f.sent() {
		if r := fr.GetResize(); r != nil {
			out = append(out, fmt.Sprintf("%dx%d", r.GetRows(), r.GetCols()))
		}
	}
	return out
}

func (f *fakeTunnels) openings() []fakeOpen {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]fakeOpen(nil), f.opens...)
}

func (f *fakeTunnels) ticketRequestsSeen() []*computev1.CreateTicketRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*computev1.CreateTicketRequest(nil), f.ticketRequests...)
}

func (f *fakeTunnels) authorize(h http.Header) error {
	if h.Get("Authorization") != "Bearer "+fakeToken {
		return connect.NewError(connect.CodeUnauthenticated, errors.New("api token is not valid"))
	}
	return nil
}

func (f *fakeTunnels) checkNode(id string) error {
	if id != f.node {
		return connect.NewError(connect.CodeNotFound, fmt.Errorf("node_id: node %s not found", id))
	}
	return nil
}

type fakeTunnelService struct{ f *fakeTunnels }

func (s fakeTunnelService) CreateTicket(_ context.Context, req *connect.Request[computev1.CreateTicketRequest]) (
	*connect.Response[computev1.CreateTicketResponse], error,
) {
	f := s.f
	if err := f.authorize(req.Header()); err != nil {
		return nil, err
	}
	if err := f.checkNode(req.Msg.GetNodeId()); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.serial++
	ticket := tunnel.TicketPrefix + "test" + strconv.Itoa(f.serial)
	f.tickets[ticket] = proto.CloneOf(req.Msg)
	f.ticketRequests = append(f.ticketRequests, proto.CloneOf(req.Msg))
	return connect.NewResponse(&computev1.CreateTicketResponse{Ticket: ticket, TicketId: "tkt_" + strconv.Itoa(f.serial),
		ExpiresAt: timestamppb.New(f.clk.Now().Add(tunnel.TicketTTL)), Path: "/api/compute/tunnels/" + ticket}), nil
}

func (s fakeTunnelService) IssueSshCertificate(_ context.Context, req *connect.Request[computev1.IssueSshCertificateRequest]) (
	*connect.Response[computev1.IssueSshCertificateResponse], error,
) {
	f := s.f
	if err := f.authorize(req.Header()); err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.certRequests = append(f.certRequests, proto.CloneOf(req.Msg))
	f.mu.Unlock()
	if err := f.checkNode(req.Msg.GetNodeId()); err != nil {
		return nil, err
	}
	key, err := sshca.ParseUserKey(req.Msg.GetPublicKey())
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("public_key: %w", err))
	}
	ca, principal := f.cas[sshca.BreakGlass], sshca.RootPrincipal
	if r := req.Msg.GetReservationId(); r != "" {
		ca, principal = f.cas[sshca.Sandbox], r
	}
	now := f.clk.Now()
	cert, err := ca.Issue(sshca.Request{Key: key, NodeID: f.node, Principal: principal, KeyID: "tok_test@" + f.node,
		ValidBefore: now.Add(req.Msg.GetTtl().AsDuration())}, now)
	if err != nil {
		return nil, connect.NewError(connect.CodeInvalidArgument, err)
	}
	return connect.NewResponse(&computev1.IssueSshCertificateResponse{Certificate: sshca.MarshalPublicKey(cert),
		Serial: cert.Serial, KeyId: cert.KeyId, Principals: cert.ValidPrincipals, Ca: ca.Name,
		ValidAfter:  timestamppb.New(timeOf(cert.ValidAfter)),
		ValidBefore: timestamppb.New(timeOf(cert.ValidBefore))}), nil
}

type fakeNodeService struct {
	computev1connect.UnimplementedNodeServiceHandler
	f *fakeTunnels
}

func (s fakeNodeService) ListNodes(_ context.Context, req *connect.Request[computev1.ListNodesRequest]) (
	*connect.Response[computev1.ListNodesResponse], error,
) {
	if err := s.f.authorize(req.Header()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&computev1.ListNodesResponse{Nodes: []*computev1.Node{
		{Id: s.f.node, Hostname: "gpu-1", ProvisionState: "adopted"}}}), nil
}

type fakeReservationService struct {
	computev1connect.UnimplementedReservationServiceHandler
	f *fakeTunnels
}

func (s fakeReservationService) GetReservation(_ context.Context, req *connect.Request[computev1.GetReservationRequest]) (
	*connect.Response[computev1.GetReservationResponse], error,
) {
	if err := s.f.authorize(req.Header()); err != nil {
		return nil, err
	}
	switch id := req.Msg.GetReservationId(); id {
	case s.f.reservation:
		return connect.NewResponse(&computev1.GetReservationResponse{Reservation: &computev1.Reservation{Id: id,
			State: "active", NodeId: s.f.node}}), nil
	case s.f.pending:
		return connect.NewResponse(&computev1.GetReservationResponse{Reservation: &computev1.Reservation{Id: id,
			State: "pending"}}), nil
	default:
		return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("reservation %s not found", id))
	}
}

// serveTunnel is GET /api/compute/tunnels/{ticket}: the ticket used once,
// for the node in the query, then the tunnel of its purpose.
func (f *fakeTunnels) serveTunnel(w http.ResponseWriter, r *http.Request) {
	ticket := r.PathValue("ticket")
	f.mu.Lock()
	f.opens = append(f.opens, fakeOpen{ticket: ticket, query: r.URL.Query(), header: r.Header.Clone()})
	req, ok := f.tickets[ticket]
	delete(f.tickets, ticket)
	refuse := f.refuse
	f.mu.Unlock()
	switch {
	case !ok:
		http.Error(w, "the ticket is not valid: used, expired or forged", http.StatusUnauthorized)
		return
	case r.URL.Query().Get("node") != req.GetNodeId():
		http.Error(w, "the ticket is for another node", http.StatusForbidden)
		return
	case refuse != nil:
		if refuse.retryAfter != "" {
			w.Header().Set("Retry-After", refuse.retryAfter)
		}
		if refuse.json != "" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(refuse.status)
			_ = json.NewEncoder(w).Encode(map[string]string{"code": refuse.json, "message": refuse.text})
			return
		}
		http.Error(w, refuse.text, refuse.status)
		return
	}
	ws, err := websocket.Accept(w, r, nil)
	if err != nil {
		return
	}
	defer func() { _ = ws.CloseNow() }()
	ws.SetReadLimit(1 << 20)
	ctx := r.Context()
	if req.GetPurpose() == tunnel.PurposeSSH {
		f.echoBytes(ctx, ws)
		return
	}
	size := [2]string{r.URL.Query().Get("rows"), r.URL.Query().Get("cols")}
	if size[0] == "" {
		size = [2]string{"24", "80"}
	}
	f.echoShell(ctx, ws, size)
}

// receive reads the frames of ws into a channel (closed at the end),
// recording each.
func (f *fakeTunnels) receive(ctx context.Context, ws *websocket.Conn) <-chan *tunnelv1.Frame {
	ch := make(chan *tunnelv1.Frame)
	go func() {
		defer close(ch)
		for {
			_, b, err := ws.Read(ctx)
			if err != nil {
				return
			}
			fr := &tunnelv1.Frame{}
			if proto.Unmarshal(b, fr) != nil {
				return
			}
			f.mu.Lock()
			f.frames = append(f.frames, fr)
			f.mu.Unlock()
			select {
			case ch <- fr:
			case <-ctx.Done():
				return
			}
		}
	}()
	return ch
}

func send(ctx context.Context, ws *websocket.Conn, fr *tunnelv1.Frame) error {
	b, err := proto.Marshal(fr)
	if err != nil {
		return err
	}
	return ws.Write(ctx, websocket.MessageBinary, b)
}

func dataFrame(b []byte) *tunnelv1.Frame {
	return &tunnelv1.Frame{Frame: &tunnelv1.Frame_Data{Data: b}}
}

// echoShell is the shell: a prompt, then per line (ended by CR or LF)
// size → "ROWS COLS", exit → exit 0, false → exit 1, close → a Close with
// fakeCloseReason, drop → the connection cut, anything else echoed; the
// end of the input exits 0.
func (f *fakeTunnels) echoShell(ctx context.Context, ws *websocket.Conn, size [2]string) {
	in := f.receive(ctx, ws)
	say := func(s string) bool { return send(ctx, ws, dataFrame([]byte(s))) == nil }
	exit := func(status int32) {
		_ = send(ctx, ws, &tunnelv1.Frame{Frame: &tunnelv1.Frame_Exit{Exit: &tunnelv1.Exit{Status: status}}})
		_ = ws.Close(websocket.StatusNormalClosure, "")
	}
	if !say("$ ") {
		return
	}
	var line []byte
	for fr := range in {
		switch x := fr.GetFrame().(type) {
		case *tunnelv1.Frame_Resize:
			size = [2]string{strconv.Itoa(int(x.Resize.GetRows())), strconv.Itoa(int(x.Resize.GetCols()))}
		case *tunnelv1.Frame_Close:
			_ = ws.Close(websocket.StatusNormalClosure, "")
			return
		case *tunnelv1.Frame_EndOfInput:
			exit(0) // as a shell whose input ends
			return
		case *tunnelv1.Frame_Data:
			for _, c := range x.Data {
				if c != '\r' && c != '\n' {
					line = append(line, c)
					continue
				}
				cmd := string(line)
				line = line[:0]
				switch cmd {
				case "":
				case "size":
					say(size[0] + " " + size[1] + "\r\n")
				case "exit":
					exit(0)
					return
				case "false":
					exit(1)
					return
				case "close":
					_ = send(ctx, ws, &tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: fakeCloseReason}}})
					_ = ws.Close(websocket.StatusNormalClosure, "")
					return
				case "drop":
					_ = ws.CloseNow()
					return
				default:
					say(cmd + "\r\n")
				}
				say("$ ")
			}
		}
	}
}

// echoBytes is the ssh tunnel: every data frame sent back as it came,
// until the client's Close or a kick (a Close with its reason).
func (f *fakeTunnels) echoBytes(ctx context.Context, ws *websocket.Conn) {
	in := f.receive(ctx, ws)
	for {
		select {
		case reason := <-f.kick:
			_ = send(ctx, ws, &tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: reason}}})
			_ = ws.Close(websocket.StatusNormalClosure, "")
			return
		case fr, ok := <-in:
			if !ok {
				return
			}
			if fr.GetClose() != nil {
				_ = ws.Close(websocket.StatusNormalClosure, "")
				return
			}
			if d := fr.GetData(); d != nil && send(ctx, ws, dataFrame(bytes.Clone(d))) != nil {
				return
			}
		}
	}
}

// dataSent returns the data frames clients sent.
func (f *fakeTunnels) dataSent() [][]byte {
	var out [][]byte
	for _, fr := range f.sent() {
		if d, ok := fr.GetFrame().(*tunnelv1.Frame_Data); ok {
			out = append(out, d.Data)
		}
	}
	return out
}

// timeOf is an OpenSSH certificate time (Unix seconds).
func timeOf(s uint64) time.Time { return time.Unix(int64(s), 0) }
