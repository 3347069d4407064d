package fakehw

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"strings"
	"sync"

	"golang.org/x/term"

	"github.com/better-compute/better-compute/pkg/tunnel"
)

// Statuses of the echo shell.
const (
	// StatusOK ends exit, Ctrl-D, the end of the input, and every command
	// but false.
	StatusOK = 0
	// StatusFalse ends false.
	StatusFalse = 1
	// StatusHangup ends a shell whose tunnel ended (ctx), as a shell killed
	// by SIGHUP reports (128 + 1).
	StatusHangup = 129
)

// Shell runs the echo shell, the fake machine's shell (docs/architecture.md,
// "Tunnels"), on term and returns its exit status.
//
// With command "" it is interactive: the prompt "<hostname>$ ", then line
// editing and echo over the raw terminal (golang.org/x/term's Terminal, at
// term's size, following its resizes), and for each line, trimmed of
// spaces:
//   - size prints "ROWS COLS", the terminal's size now;
//   - hostname prints the machine's host name (Hostname);
//   - exit ends the shell with StatusOK;
//   - false ends it with StatusFalse;
//   - an empty line prints nothing; any other line is printed back.
//
// Ctrl-D on an empty line, or the end of the input, ends it with StatusOK;
// Ctrl-C drops the line being typed and prompts again. Otherwise command is
// one line, run as the interactive shell would run it, without prompt or
// echo (an ssh exec): its output, then its status (exit and every line but
// false StatusOK); the command cat copies its input to its output until the
// input ends (as a real machine's cat does; a throughput benchmark reads it
// back). Output lines end in "\r\n" on a terminal, "\n" without
// one (term's Size zero). A shell whose ctx ends returns StatusHangup once
// its input returns (the agent ends the input with the tunnel).
//
// Shell reads only what never changes after New (the host name), so it may
// run on its own goroutine concurrently with the Machine's other methods
// and with other shells.
func (m *Machine) Shell(ctx context.Context, t tunnel.Terminal, command string) int {
	if strings.TrimSpace(command) == "cat" {
		// Its input to its output, until the input ends: what a
		// benchmark of a tunnel's throughput reads back.
		_, _ = io.Copy(t, t)
		return StatusOK
	}
	if command != "" {
		nl := "\n"
		if t.Size() != (tunnel.Size{}) {
			nl = "\r\n"
		}
		var out strings.Builder
		status, _ := m.shellLine(&out, t, command)
		_, _ = io.WriteString(t, strings.ReplaceAll(out.String(), "\n", nl))
		return status
	}
	vt := term.NewTerminal(&interruptible{Terminal: t}, m.hostname+"$ ")
	resize := func() {
		if s := t.Size(); s.Cols > 0 && s.Rows > 0 {
			_ = vt.SetSize(s.Cols, s.Rows)
		}
	}
	resize()
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-t.Resized():
				resize()
			case <-done:
				return
			}
		}
	})
	defer wg.Wait()
	defer close(done)
	for {
		line, err := vt.ReadLine()
		if ctx.Err() != nil {
			return StatusHangup
		}
		if err != nil {
			return StatusOK // Ctrl-D, or the input ended
		}
		var out bytes.Buffer
		status, end := m.shellLine(&out, t, line)
		if out.Len() > 0 {
			_, _ = vt.Write(out.Bytes())
		}
		if end {
			return status
		}
	}
}

// shellLine runs one line of the echo shell, writing its output to out
// with "\n" line ends, and returns its status and whether it ends the
// shell.
func (m *Machine) shellLine(out io.Writer, t tunnel.Terminal, line string) (status int, end bool) {
	switch strings.TrimSpace(line) {
	case "":
	case "size":
		s := t.Size()
		fmt.Fprintf(out, "%d %d\n", s.Rows, s.Cols)
	case "hostname":
		fmt.Fprintln(out, m.hostname)
	case "exit":
		return StatusOK, true
	case "false":
		return StatusFalse, true
	default:
		fmt.Fprintln(out, line)
	}
	return StatusOK, false
}

// ctrlC is what interruptible reads instead of a Ctrl-C (ETX): to the
// start of the line (^A), delete to its end (^K), and enter, so that
// x/term's Terminal, which ends on a Ctrl-C, returns an empty line instead
// and the shell prompts again.
var ctrlC = []byte{0x01, 0x0b, '\r'}

// interruptible is the shell's terminal with each Ctrl-C read as ctrlC. A
// 0x03 byte is always a Ctrl-C: it occurs in no UTF-8 sequence and no
// escape sequence a terminal sends (bracketed paste stays off).
type interruptible struct {
	tunnel.Terminal
	pending []byte // translated input not returned yet
	err     error  // the input's error, returned once pending is
}

// Read reads input, translating Ctrl-C.
func (r *interruptible) Read(p []byte) (int, error) {
	if len(r.pending) == 0 {
		if r.err != nil {
			return 0, r.err
		}
		n, err := r.Terminal.Read(p)
		if bytes.IndexByte(p[:n], 0x03) < 0 {
			return n, err
		}
		for _, b := range p[:n] {
			if b == 0x03 {
				r.pending = append(r.pending, ctrlC...)
			} else {
				r.pending = append(r.pending, b)
			}
		}
		r.err = err
	}
	n := copy(p, r.pending)
	r.pending = r.pending[n:]
	return n, nil
}
