package agent

// Tunnels, the driver's side (docs/architecture.md, "Tunnels"): the daemon
// core turns an OpenTunnel of the established session into
// daemon.EffectOpenTunnel; the driver dials GatewayService.Tunnel to that
// session's gateway over the machine's transport (mutual TLS with the node
// certificate), names the tunnel in its first message and serves it on
// goroutines of its own: a shell tunnel runs the Hardware's Shell on a
// terminal fed by the frames, an ssh tunnel carries one connection to the
// machine's SSH server (sshd.go). Tunnels end with the machine's boot: the
// driver cancels them when the machine stops for good, reboots or its loop
// ends, and the loop waits for their goroutines before it returns.

import (
	"context"
	"errors"
	"io"
	"sync"
	"time"

	"connectrpc.com/connect"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/telemetry"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// MaxTunnels is how many tunnels one machine serves at a time; the gateway
// is told why a tunnel beyond it is closed at once. The API limits open
// tunnels per node too; this bounds what a machine spends on them whatever
// the control plane asks.
const MaxTunnels = 32

// Log attribute keys of tunnels.
const (
	keyTunnelID = "tunnel.id"
	keyPurpose  = "tunnel.purpose"
)

// tunnelGrace is how long a tunnel that ended on the node's side waits for
// the gateway to end the stream (so that its last frames, the exit status
// or the close, reach it) before it drops the stream.
const tunnelGrace = 5 * time.Second

// tunnelSet is the tunnels of one machine; only the driver's loop calls
// open and end, the counters are safe for concurrent use.
type tunnelSet struct {
	ctx    context.Context // the tunnels of this boot; nil when none opened since the last end
	cancel context.CancelFunc
	wg     sync.WaitGroup // every tunnel goroutine, of every boot
	mu     sync.Mutex
	n      int // tunnels open
}

// endTunnels ends every open tunnel (why is logged) without waiting for
// them: the machine stops, reboots or its loop ends.
func (d *driver) endTunnels(why string) {
	if d.tun.ctx == nil {
		return
	}
	if n := d.tunnelCount(0); n > 0 {
		d.log.Info("closing the machine's tunnels", "reason", why, "tunnels", n)
	}
	d.tun.cancel()
	d.tun.ctx, d.tun.cancel = nil, nil
}

// waitTunnels ends every tunnel and waits for their goroutines.
func (d *driver) waitTunnels() {
	d.endTunnels("the machine stops")
	d.tun.wg.Wait()
}

// tunnelCount adds delta to the open tunnels and returns how many are open,
// keeping MachineStatus.Tunnels equal to it.
func (d *driver) tunnelCount(delta int) int {
	d.tun.mu.Lock()
	defer d.tun.mu.Unlock()
	d.tun.n += delta
	if delta != 0 {
		n := d.tun.n
		d.m.update(func(s *MachineStatus) { s.Tunnels = n })
	}
	return d.tun.n
}

// openTunnel carries out daemon.EffectOpenTunnel on session s: it serves
// the tunnel on a goroutine of its own, dialled to s's gateway.
func (d *driver) openTunnel(s *session, ot *gatewayv1.OpenTunnel) {
	if d.tun.ctx == nil {
		d.tun.ctx, d.tun.cancel = context.WithCancel(d.ctx)
	}
	ctx := d.tun.ctx
	refuse := ""
	if d.tunnelCount(1) > MaxTunnels {
		refuse = "too many tunnels open on this machine"
	}
	d.tun.wg.Go(func() {
		defer d.tunnelCount(-1)
		d.serveTunnel(ctx, s.client, ot, refuse)
	})
}

// serveTunnel dials the tunnel, names it and serves it until it ends; with
// refuse set it closes it at once saying so.
func (d *driver) serveTunnel(ctx context.Context, client tunnelClient, ot *gatewayv1.OpenTunnel, refuse string) {
	log := d.log.With(keyTunnelID, ot.GetTunnelId(), keyPurpose, ot.GetPurpose())
	ctx, cancel := context.WithCancel(ctx)
	stream := client.Tunnel(ctx)
	// Once the tunnel is cancelled, end its request stream too: net/http's
	// HTTP/2 client does not watch the context while it reads a request
	// body, and a Send blocked on a gateway that stopped reading returns
	// only once the body is closed.
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		<-ctx.Done()
		_ = stream.CloseRequest()
	}()
	defer func() {
		cancel()
		<-closed
		_ = stream.CloseResponse()
	}()
	f := &tunnelFrames{stream: stream}
	if err := stream.Send(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Start{Start: &gatewayv1.TunnelStart{
		TunnelId: ot.GetTunnelId(),
	}}}); err != nil {
		log.Warn("could not open the tunnel", telemetry.KeyError, err)
		return
	}
	if refuse != "" {
		log.Warn("tunnel refused", "reason", refuse, "max", MaxTunnels)
		_ = tunnel.NewConn(f).CloseWith(refuse)
		d.drain(ctx, cancel, f)
		return
	}
	start := d.clk.Now()
	log.Info("tunnel open")
	switch ot.GetPurpose() {
	case tunnel.PurposeShell:
		status, err := d.serveShell(ctx, cancel, f, ot.GetSize())
		log.Info("tunnel closed", "status", status, "open_for", clock.Since(d.clk, start).String(), telemetry.KeyError, err)
	case tunnel.PurposeSSH:
		c := tunnel.NewConn(f)
		err := d.sshd.serve(ctx, cancel, c, log)
		_ = c.Close()
		d.drain(ctx, cancel, f)
		log.Info("tunnel closed", "open_for", clock.Since(d.clk, start).String(), telemetry.KeyError, err)
	}
}

// drain reads what the gateway still sends until it ends the stream, at
// most tunnelGrace, so that what was sent last reaches it; then cancel
// ends the stream. Nothing else may read f meanwhile.
func (d *driver) drain(ctx context.Context, cancel context.CancelFunc, f *tunnelFrames) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			if _, err := f.Receive(); err != nil {
				return
			}
		}
	}()
	d.graceWait(ctx, done)
	cancel()
	<-done
}

// graceWait waits until done is closed, ctx ends or tunnelGrace passed.
func (d *driver) graceWait(ctx context.Context, done <-chan struct{}) {
	t := d.clk.NewTimer(tunnelGrace)
	defer t.Stop()
	select {
	case <-done:
	case <-ctx.Done():
	case <-t.C():
	}
}

// serveShell runs the Hardware's interactive shell on a terminal fed by
// the tunnel's frames (data: keystrokes, resize: the size) and sends its
// output as data frames, then its exit status, and half-closes; cancel
// ends the stream once the gateway ended it or tunnelGrace passed. An
// EndOfInput frame, a Close frame or the end of the stream ends the
// shell's input (and, for a Close or an error, its context). It returns the status and why the client's
// side ended early, if it did.
func (d *driver) serveShell(ctx context.Context, cancel context.CancelFunc, f *tunnelFrames, size *tunnelv1.TerminalSize) (int, error) {
	pr, pw := io.Pipe()
	out := &frameWriter{f: f}
	term := tunnel.NewTerm(pr, out, sizeOf(size))
	shellCtx, stopShell := context.WithCancel(ctx)
	defer stopShell()
	var ended error // why the client's side ended; read after recvDone
	recvDone := make(chan struct{})
	go func() {
		defer close(recvDone)
		for {
			fr, err := f.Receive()
			if err != nil {
				if !errors.Is(err, io.EOF) && ended == nil {
					ended = err
					stopShell()
				}
				_ = pw.CloseWithError(io.EOF)
				return
			}
			switch x := fr.GetFrame().(type) {
			case *tunnelv1.Frame_Data:
				_, _ = pw.Write(x.Data) // fails once the shell is gone: dropped
			case *tunnelv1.Frame_Resize:
				term.Resize(sizeOf(x.Resize))
			case *tunnelv1.Frame_EndOfInput:
				// The client's input ended: so does the shell's; the
				// client still reads its output and status.
				_ = pw.CloseWithError(io.EOF)
			case *tunnelv1.Frame_Close:
				if ended == nil {
					ended = &tunnel.ClosedError{Reason: x.Close.GetReason()}
				}
				stopShell()
				_ = pw.CloseWithError(io.EOF)
			}
		}
	}()
	status := d.hw.Shell(shellCtx, term, "")
	_ = pr.Close() // a frame the shell did not read no longer blocks the reader
	if ctx.Err() == nil {
		if err := out.send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Exit{Exit: &tunnelv1.Exit{Status: int32(status & 0xff)}}}); err == nil {
			_ = f.CloseSend()
		}
		d.graceWait(ctx, recvDone)
	}
	cancel()
	<-recvDone
	return status, ended
}

// sizeOf returns the terminal size of a frame, the zero Size for none.
func sizeOf(s *tunnelv1.TerminalSize) tunnel.Size {
	if s == nil {
		return tunnel.Size{}
	}
	return tunnel.Size{Rows: int(s.GetRows()), Cols: int(s.GetCols())}
}

// tunnelClient opens the node's end of a tunnel
// (gatewayv1connect.GatewayServiceClient's Tunnel).
type tunnelClient interface {
	Tunnel(ctx context.Context) *connect.BidiStreamForClient[gatewayv1.TunnelRequest, tunnelv1.Frame]
}

// tunnelFrames is the node's Tunnel stream as tunnel.Frames: frames sent
// go as TunnelRequest.frame.
type tunnelFrames struct {
	stream *connect.BidiStreamForClient[gatewayv1.TunnelRequest, tunnelv1.Frame]
}

// Send sends one frame.
func (f *tunnelFrames) Send(fr *tunnelv1.Frame) error {
	return f.stream.Send(&gatewayv1.TunnelRequest{Msg: &gatewayv1.TunnelRequest_Frame{Frame: fr}})
}

// Receive returns the next frame.
func (f *tunnelFrames) Receive() (*tunnelv1.Frame, error) { return f.stream.Receive() }

// CloseSend half-closes the stream.
func (f *tunnelFrames) CloseSend() error { return f.stream.CloseRequest() }

// frameWriter is a shell's output: each Write goes as data frames of at
// most tunnel.MaxChunk. Safe for concurrent use.
type frameWriter struct {
	mu sync.Mutex
	f  *tunnelFrames
}

// Write sends p as data frames.
func (w *frameWriter) Write(p []byte) (int, error) {
	n := 0
	for len(p) > 0 {
		chunk := p[:min(len(p), tunnel.MaxChunk)]
		// The frame may outlive the call (a buffered stream): copy.
		if err := w.send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Data{Data: append([]byte(nil), chunk...)}}); err != nil {
			return n, err
		}
		n += len(chunk)
		p = p[len(chunk):]
	}
	return n, nil
}

func (w *frameWriter) send(fr *tunnelv1.Frame) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.f.Send(fr)
}
