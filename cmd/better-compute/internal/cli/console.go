package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/ids"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

// detachKey is Ctrl-] (telnet's escape): in console's input it detaches.
const detachKey = 0x1d

// maxTerminalSide is the most rows or columns a resize carries
// (bc.tunnel.v1.TerminalSize allows 1 to 10000).
const maxTerminalSide = 10000

func (a *app) consoleCmd() *cobra.Command {
	var node string
	c := &cobra.Command{
		Use:   "console --node NODE_ID",
		Short: "Open the shell of a node's machine on your terminal (Ctrl-] detaches)",
		Long: "console opens the shell of a node's machine on your terminal, through a tunnel: it asks the API\n" +
			"for an exec ticket (TunnelService.CreateTicket, purpose shell) and opens the tunnel as a WebSocket at\n" +
			"/api/compute/tunnels/<ticket>. While it runs your terminal is in raw mode: every key goes to the\n" +
			"machine (Ctrl-C and Ctrl-Z too), and the machine's terminal follows your terminal's size. The\n" +
			"terminal is restored however console ends.\n\n" +
			"Ctrl-] detaches: console closes the tunnel, prints \"detached from NODE_ID\" and exits 0. When the\n" +
			"shell ends, console exits with its status (exit: 0, false: 1). It exits 255 when the tunnel could\n" +
			"not be opened (the API's error, or its refusal: the node has no live session, a limit of open\n" +
			"tunnels) or ended without the shell's status (\"console: <reason>\": the node was revoked, your\n" +
			"token lost its right, the connection dropped). Input that is not a terminal is sent as it comes,\n" +
			"Ctrl-] bytes included, without raw mode or sizes; its end ends the shell's input, as a pipe's\n" +
			"would, and console exits with the shell's status. Needs a tenant-admin token of the node's\n" +
			"tenant or a root-admin token.",
		Args: cobra.NoArgs,
	}
	c.Flags().StringVar(&node, "node", "", "node id (required)")
	_ = c.MarkFlagRequired("node")
	_ = c.RegisterFlagCompletionFunc("node", a.completeNodeIDs)
	c.RunE = func(cmd *cobra.Command, _ []string) error {
		return a.console(cmd.Context(), canonicalID(ids.Node, node))
	}
	return c
}

// terminalSize is a terminal's size in character cells.
type terminalSize struct{ rows, cols uint32 }

// sizeOf reads the size of the terminal fd; false when it has none.
func sizeOf(fd int) (terminalSize, bool) {
	w, h, err := term.GetSize(fd)
	if err != nil || w <= 0 || h <= 0 {
		return terminalSize{}, false
	}
	return terminalSize{rows: uint32(min(h, maxTerminalSide)), cols: uint32(min(w, maxTerminalSide))}, true
}

// terminalFD returns the descriptor of r when it is a terminal.
func terminalFD(r io.Reader) (int, bool) {
	f, ok := r.(*os.File)
	if !ok {
		return 0, false
	}
	fd := int(f.Fd())
	return fd, term.IsTerminal(fd)
}

// consoleEnd is how a console session ended.
type consoleEnd struct {
	detached bool
	// exited is set when the shell sent its exit status.
	exited bool
	status int32
	// reason says why the tunnel ended otherwise.
	reason string
}

// console runs the shell of node on the terminal (or whatever stdin and
// stdout are) and returns how to exit.
func (a *app) console(ctx context.Context, node string) error {
	in := a.env.Stdin
	if in == nil {
		in = strings.NewReader("")
	}
	fd, isTerm := terminalFD(in)
	query := url.Values{"node": {node}}
	var winch chan os.Signal
	var size terminalSize
	if isTerm {
		// Before the size is read, so that no change is missed.
		winch = make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
		var ok bool
		if size, ok = sizeOf(fd); ok {
			query.Set("rows", strconv.FormatUint(uint64(size.rows), 10))
			query.Set("cols", strconv.FormatUint(uint64(size.cols), 10))
		}
	}
	t, err := a.openTunnel(ctx, &computev1.CreateTicketRequest{NodeId: node, Purpose: tunnel.PurposeShell}, query)
	if err != nil {
		// console reaches root's shell only: a reservation's sandbox is
		// ssh's.
		fmt.Fprintln(a.env.Stderr, strings.Replace(FormatError(err), "pass --reservation for the sandbox",
			"ssh-cert and ssh-proxy take --reservation RES_ID for the sandbox", 1))
		return exitError{tunnelFailed}
	}
	defer t.close()

	restore := func() {}
	// nl starts console's own lines: after raw output the cursor may be
	// anywhere on its line.
	nl := ""
	if isTerm {
		fmt.Fprintf(a.env.Stderr, "connected to %s; Ctrl-] detaches\n", node)
		st, err := term.MakeRaw(fd)
		if err != nil {
			_ = t.sendClose(reasonClosed)
			fmt.Fprintf(a.env.Stderr, "console: raw mode: %v\n", err)
			return exitError{tunnelFailed}
		}
		var once sync.Once
		restore = func() { once.Do(func() { _ = term.Restore(fd, st) }) }
		// Restored on every return, a panic included; the terminal's
		// signals (SIGHUP) and SIGTERM cancel ctx and return below.
		defer restore()
		nl = "\r\n"
	}

	end := a.consoleSession(ctx, t, in, fd, size, winch)
	restore()
	switch {
	case end.detached:
		fmt.Fprintf(a.env.Stderr, "%sdetached from %s\n", nl, node)
		return nil
	case end.exited:
		if end.status == 0 {
			return nil
		}
		return exitError{int(min(max(end.status, 0), 255))}
	}
	fmt.Fprintf(a.env.Stderr, "%sconsole: %s\n", nl, cell(end.reason))
	return exitError{tunnelFailed}
}

// consoleSession pumps stdin to the tunnel, the tunnel to stdout and, with
// winch, the terminal's size to the tunnel, until the shell exits, the
// tunnel ends, Ctrl-] is read or ctx ends. It closes the tunnel and returns
// once nothing but the read of stdin (which cannot be interrupted) is left.
func (a *app) consoleSession(ctx context.Context, t *wsFrames, in io.Reader, fd int, size terminalSize,
	winch <-chan os.Signal,
) consoleEnd {
	var wg sync.WaitGroup
	ended := make(chan consoleEnd, 1)
	wg.Go(func() { ended <- receiveConsole(t, a.env.Stdout) })
	if winch != nil {
		wg.Go(func() { followSize(t, fd, size, winch) })
	}
	detached := make(chan struct{})
	go sendConsoleInput(t, in, winch != nil, detached)

	var end consoleEnd
	select {
	case end = <-ended:
	case <-detached:
		_ = t.sendClose(reasonDetached)
		end = consoleEnd{detached: true}
	case <-ctx.Done():
		_ = t.sendClose(reasonInterrupted)
		end = consoleEnd{reason: reasonInterrupted}
	}
	t.close()
	wg.Wait()
	return end
}

// receiveConsole writes the data frames of t to out until the shell's exit
// status, a Close or the end of the tunnel.
func receiveConsole(t *wsFrames, out io.Writer) consoleEnd {
	for {
		fr, err := t.Receive()
		if err != nil {
			var closed *tunnel.ClosedError
			switch {
			case errors.Is(err, io.EOF):
				return consoleEnd{reason: "the tunnel ended without the shell's exit status"}
			case errors.As(err, &closed):
				return consoleEnd{reason: closed.Reason}
			}
			return consoleEnd{reason: err.Error()}
		}
		switch x := fr.GetFrame().(type) {
		case *tunnelv1.Frame_Data:
			if _, err := out.Write(x.Data); err != nil {
				return consoleEnd{reason: "write the output: " + err.Error()}
			}
		case *tunnelv1.Frame_Exit:
			return consoleEnd{exited: true, status: x.Exit.GetStatus()}
		case *tunnelv1.Frame_Close:
			reason := x.Close.GetReason()
			if reason == "" {
				reason = "the tunnel was closed"
			}
			return consoleEnd{reason: reason}
		}
	}
}

// sendConsoleInput sends what it reads from in as data frames of at most
// tunnel.MaxChunk, up to a Ctrl-] typed on a terminal (typed: then it
// closes detached; in input that is not a terminal it is data like any
// byte) or the end of in: then it sends an EndOfInput frame, so that the
// shell's input ends as a pipe's would (the shell then exits, and console
// with its status).
func sendConsoleInput(t *wsFrames, in io.Reader, typed bool, detached chan<- struct{}) {
	buf := make([]byte, tunnel.MaxChunk)
	for {
		n, err := in.Read(buf)
		if n > 0 {
			chunk := buf[:n]
			i := -1
			if typed {
				i = bytes.IndexByte(chunk, detachKey)
			}
			if i >= 0 {
				chunk = chunk[:i]
			}
			// Send marshals the frame before it returns: buf may be reused.
			if len(chunk) > 0 && t.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Data{Data: chunk}}) != nil {
				return
			}
			if i >= 0 {
				close(detached)
				return
			}
		}
		if errors.Is(err, io.EOF) {
			_ = t.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_EndOfInput{EndOfInput: &tunnelv1.EndOfInput{}}})
			return
		}
		if err != nil {
			return
		}
	}
}

// followSize sends a resize frame each time winch says the terminal fd
// changed size (and it did, from last), until the tunnel is closed.
func followSize(t *wsFrames, fd int, last terminalSize, winch <-chan os.Signal) {
	for {
		select {
		case <-t.ctx.Done():
			return
		case <-winch:
		}
		s, ok := sizeOf(fd)
		if !ok || s == last {
			continue
		}
		last = s
		if t.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Resize{Resize: &tunnelv1.TerminalSize{Rows: s.rows, Cols: s.cols}}}) != nil {
			return
		}
	}
}
