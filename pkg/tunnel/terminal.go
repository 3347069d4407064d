package tunnel

import (
	"io"
	"sync"
)

// Size is a terminal's size in character cells. The zero Size means there
// is no terminal (an SSH exec without a pty).
type Size struct {
	Rows, Cols int
}

// Terminal is what a machine's shell runs on (agent.Hardware's Shell): the
// client's terminal at the far end of a shell tunnel or of an SSH session.
//
// Input is raw: Read returns the client's keystrokes as typed, with no echo
// and no line editing done on the client's side (the shell echoes and edits
// lines itself, e.g. with golang.org/x/term's Terminal, and turns "\n" into
// "\r\n" on output). Read returns io.EOF once the input ends (the client
// closed it) and an error once the tunnel ended; a shell that reads its
// input ends then.
//
// Read is called from one goroutine at a time, Write likewise (serialize
// writers: x/term's Terminal does); Read, Write, Size and Resized may be
// called concurrently with each other.
type Terminal interface {
	io.Reader
	io.Writer
	// Size returns the terminal's size now, after every resize the client
	// sent before the input Read returned so far.
	Size() Size
	// Resized returns a channel that receives a value after the size
	// changed; one value stands for every change since the last one was
	// received (call Size for the size now). It is the same channel at
	// every call and is never closed.
	Resized() <-chan struct{}
}

// Term is a Terminal over an input and an output whose size its owner
// sets (Resize). Safe for concurrent use as Terminal says.
type Term struct {
	in      io.Reader
	out     io.Writer
	mu      sync.Mutex
	size    Size
	resized chan struct{}
}

// NewTerm returns a Term reading in, writing out, of size size (the zero
// Size for no terminal).
func NewTerm(in io.Reader, out io.Writer, size Size) *Term {
	return &Term{in: in, out: out, size: size, resized: make(chan struct{}, 1)}
}

// Read reads the input.
func (t *Term) Read(p []byte) (int, error) { return t.in.Read(p) }

// Write writes the output.
func (t *Term) Write(p []byte) (int, error) { return t.out.Write(p) }

// Size returns the size now.
func (t *Term) Size() Size {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.size
}

// Resized returns the channel Resize signals.
func (t *Term) Resized() <-chan struct{} { return t.resized }

// Resize sets the size and signals Resized when it changed. It never
// blocks.
func (t *Term) Resize(s Size) {
	t.mu.Lock()
	changed := s != t.size
	t.size = s
	t.mu.Unlock()
	if !changed {
		return
	}
	select {
	case t.resized <- struct{}{}:
	default: // a signal is pending already: it stands for this change too
	}
}
