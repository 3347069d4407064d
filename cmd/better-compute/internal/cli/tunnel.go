package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/coder/websocket"
	"google.golang.org/protobuf/proto"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// Tunnels (docs/architecture.md, "Tunnels"): console and ssh-proxy ask the
// API for an exec ticket (TunnelService.CreateTicket) and open the tunnel it
// grants as a WebSocket at the ticket's path under the API's base URL, with
// the node's id in the query; each binary WebSocket message is one
// bc.tunnel.v1.Frame.
const (
	// tunnelDialTimeout bounds the WebSocket upgrade (the ticket itself is
	// valid for tunnel.TicketTTL).
	tunnelDialTimeout = 30 * time.Second
	// tunnelReadLimit is the largest WebSocket message read, in bytes: a
	// Frame of 64 KiB of data (what bc.tunnel.v1.Frame allows) and its
	// encoding.
	tunnelReadLimit = 64<<10 + 1<<10
	// tunnelFailed is the exit status of console and ssh-proxy when the
	// tunnel could not be opened or ended without a status, as ssh's.
	tunnelFailed = 255
	// reasonClosed is the Close reason of an end that closed its side
	// normally: what tunnel.Conn.Close sends, and what ssh-proxy sends when
	// ssh closed its standard input.
	reasonClosed = "closed"
	// reasonDetached is the Close reason console sends on Ctrl-].
	reasonDetached = "detached"
	// reasonInterrupted is the Close reason console sends when it is
	// interrupted (SIGTERM, SIGHUP: the terminal went away).
	reasonInterrupted = "interrupted"
)

// openTunnel creates a ticket for req and opens the tunnel it grants, with
// query (node, and a shell's rows and cols). The WebSocket upgrade carries
// the bearer token and X-BC-Tenant as the API calls do. Errors: the API's
// (Connect) error from CreateTicket, a *tunnelRefusedError when the API
// answers the upgrade with an HTTP status, or the connection's failure.
func (a *app) openTunnel(ctx context.Context, req *computev1.CreateTicketRequest, query url.Values) (*wsFrames, error) {
	cl, err := a.clients()
	if err != nil {
		return nil, err
	}
	token, err := a.apiToken()
	if err != nil {
		return nil, err
	}
	res, err := cl.tunnels.CreateTicket(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, asFlags(err)
	}
	base, err := a.baseURL()
	if err != nil {
		return nil, err
	}
	u, err := tunnelURL(base, res.Msg.GetPath(), res.Msg.GetTicket(), query)
	if err != nil {
		return nil, err
	}
	h := http.Header{}
	h.Set("Authorization", "Bearer "+token)
	if tenant := a.env.Getenv("BETTER_COMPUTE_TENANT"); tenant != "" {
		h.Set("X-BC-Tenant", tenant)
	}
	dctx, cancel := context.WithTimeout(ctx, tunnelDialTimeout)
	defer cancel()
	// No client timeout: the tunnel lasts as long as it is used.
	ws, resp, err := websocket.Dial(dctx, u, &websocket.DialOptions{HTTPClient: &http.Client{}, HTTPHeader: h})
	if resp != nil && resp.Body != nil {
		// What Dial kept of a refusal's body (nil after an upgrade).
		defer resp.Body.Close()
	}
	if err != nil {
		if resp != nil && resp.StatusCode != http.StatusSwitchingProtocols {
			return nil, refusal(resp)
		}
		return nil, fmt.Errorf("open the tunnel to %s: %w", req.GetNodeId(), err)
	}
	ws.SetReadLimit(tunnelReadLimit)
	fctx, fcancel := context.WithCancel(context.WithoutCancel(ctx))
	return &wsFrames{ctx: fctx, cancel: fcancel, ws: ws}, nil
}

// tunnelURL is the tunnel's WebSocket URL: base (the API's base URL) and
// path (CreateTicketResponse.path; when empty, the architecture's
// /api/compute/tunnels/<ticket>), with query.
func tunnelURL(base, path, ticket string, query url.Values) (string, error) {
	if path == "" {
		path = apiPath + "/tunnels/" + url.PathEscape(ticket)
	}
	if !strings.HasPrefix(path, "/") {
		path = "/" + path
	}
	u, err := url.Parse(base + path)
	if err != nil {
		return "", fmt.Errorf("the tunnel's URL: %w", err)
	}
	u.RawQuery = query.Encode()
	return u.String(), nil
}

// tunnelRefusedError is the API's refusal of a tunnel, answered to the
// WebSocket upgrade: an HTTP status (401 ticket, 403 or 409 the caller's
// right or the node's state, 429 a limit) with a text reason.
type tunnelRefusedError struct {
	Status int
	Reason string
	// RetryAfter is the Retry-After header of a 429, as sent ("" without).
	RetryAfter string
}

func (e *tunnelRefusedError) Error() string {
	s := fmt.Sprintf("tunnel refused: %s (HTTP %d", e.Reason, e.Status)
	if e.RetryAfter != "" {
		if n, err := strconv.Atoi(e.RetryAfter); err == nil {
			s += fmt.Sprintf("; retry after %s", time.Duration(n)*time.Second)
		} else {
			s += "; retry after " + e.RetryAfter
		}
	}
	return s + ")"
}

// refusal reads the API's refusal of an upgrade: its status, its reason
// and Retry-After. The reason is "code: message" of the API's JSON body
// {"code", "message"}, else the first line of a text body (a proxy's;
// websocket.Dial keeps up to 1 KiB of it), else the status's name.
func refusal(resp *http.Response) *tunnelRefusedError {
	e := &tunnelRefusedError{Status: resp.StatusCode, RetryAfter: cell(resp.Header.Get("Retry-After"))}
	if resp.Body != nil {
		b, _ := io.ReadAll(resp.Body)
		var body struct{ Code, Message string }
		if json.Unmarshal(b, &body) == nil && body.Message != "" {
			e.Reason = body.Message
			if body.Code != "" {
				e.Reason = body.Code + ": " + body.Message
			}
			e.Reason = cell(e.Reason)
		} else {
			line, _, _ := strings.Cut(strings.TrimSpace(string(b)), "\n")
			e.Reason = cell(strings.TrimSpace(line))
		}
	}
	if e.Reason == "" {
		e.Reason = strings.ToLower(http.StatusText(resp.StatusCode))
	}
	return e
}

// wsFrames is tunnel.Frames over a tunnel's WebSocket. Send may be called
// from several goroutines (websocket.Conn's writes are safe for that);
// Receive from one.
type wsFrames struct {
	// ctx ends with close, which ends the connection; it outlives the
	// command's context so that a Close frame can still be sent after an
	// interrupt.
	ctx    context.Context
	cancel context.CancelFunc
	ws     *websocket.Conn
}

// tunnelLostError is a tunnel's connection to the API failing without a
// Close frame or a WebSocket close with a reason. It does not unwrap: the
// io.EOF of a connection cut is not the end of the stream.
type tunnelLostError struct{ err error }

func (e *tunnelLostError) Error() string {
	var ce websocket.CloseError
	if errors.As(e.err, &ce) {
		return fmt.Sprintf("the API server closed the tunnel (WebSocket status %d)", int(ce.Code))
	}
	return "lost the connection to the API server: " + e.err.Error()
}

// Send sends one frame as a binary message.
func (f *wsFrames) Send(fr *tunnelv1.Frame) error {
	b, err := proto.Marshal(fr)
	if err != nil {
		return err
	}
	return f.ws.Write(f.ctx, websocket.MessageBinary, b)
}

// Receive returns the next frame. A WebSocket closed normally without a
// reason is io.EOF; one closed with a reason (with any status) is a
// *tunnel.ClosedError, as a Close frame would be; any other failure a
// *tunnelLostError. Messages that are not binary, and frames of a kind this
// CLI does not know, are skipped.
func (f *wsFrames) Receive() (*tunnelv1.Frame, error) {
	for {
		typ, b, err := f.ws.Read(f.ctx)
		if err != nil {
			var ce websocket.CloseError
			switch {
			case errors.As(err, &ce) && ce.Reason != "":
				return nil, &tunnel.ClosedError{Reason: ce.Reason}
			case websocket.CloseStatus(err) == websocket.StatusNormalClosure:
				return nil, io.EOF
			}
			return nil, &tunnelLostError{err: err}
		}
		if typ != websocket.MessageBinary {
			continue
		}
		fr := &tunnelv1.Frame{}
		if err := proto.Unmarshal(b, fr); err != nil {
			return nil, &tunnelLostError{err: fmt.Errorf("a frame that does not parse: %w", err)}
		}
		if fr.GetFrame() == nil {
			continue
		}
		return fr, nil
	}
}

// CloseSend closes the WebSocket normally (the closing handshake: it waits
// a few seconds at most for the API's answer). The protocol has no half
// close: Receive returns an error after it.
func (f *wsFrames) CloseSend() error {
	err := f.ws.Close(websocket.StatusNormalClosure, "")
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// close closes the WebSocket (normally, when CloseSend has not) and ends
// every call on it; it is safe to call more than once.
func (f *wsFrames) close() {
	_ = f.ws.Close(websocket.StatusNormalClosure, "")
	f.cancel()
	_ = f.ws.CloseNow()
}

// sendClose sends a Close frame with reason.
func (f *wsFrames) sendClose(reason string) error {
	return f.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: reason}}})
}

// canonicalID returns s as the API spells ids of kind p: a well-formed id
// of that kind in any case ("node_01jabc…": ssh lowercases the host names
// it gives ProxyCommand as %h) with the ULID in upper case, as ids.New
// writes it. Anything else is returned as given (trimmed), for the API to
// refuse.
func canonicalID(p ids.Prefix, s string) string {
	s = strings.TrimSpace(s)
	prefix, rest, ok := strings.Cut(s, "_")
	if !ok || !strings.EqualFold(prefix, string(p)) {
		return s
	}
	c := string(p) + "_" + strings.ToUpper(rest)
	if ids.Check(p, c) != nil {
		return s
	}
	return c
}

// tunnelFlags are the flags of the tunnel commands by the request field
// they set.
var tunnelFlags = map[string]string{"node_id": "--node", "reservation_id": "--reservation", "public_key": "--public-key",
	"ttl": "--ttl"}

// asFlags is err in the words of the tunnel commands' flags (fieldWords
// with tunnelFlags): "reservation_id: reservation res_… is released, not
// active" becomes "--reservation: …", so that the error names what the user
// typed.
func asFlags(err error) error {
	return fieldWords(err, tunnelFlags)
}
