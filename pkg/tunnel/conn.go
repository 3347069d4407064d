package tunnel

import (
	"errors"
	"io"
	"net"
	"sync"
	"time"

	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
)

// MaxChunk is the most data one frame carries (tunnelv1.Frame.data allows
// 64 KiB; writers split at this).
const MaxChunk = 32 << 10

// MaxMessageBytes bounds, in bytes, one tunnel message a server reads (the
// gateway's Tunnel handlers, the API's WebSocket and its gateway client): a
// Frame, whose data is at most 64 KiB and whose other kinds are smaller (a
// close reason of at most 1024 characters), or a TunnelRequest's start (a
// ticket of at most 4 KiB and a 64-byte id), with room for their framing.
const MaxMessageBytes = 64<<10 + 1024

// Frames is one end of a stream of tunnel frames: what Conn reads from and
// writes to. Send and Receive are each called from one goroutine at a time.
type Frames interface {
	// Send sends one frame.
	Send(*tunnelv1.Frame) error
	// Receive returns the next frame; an error (io.EOF when the other end
	// closed its side) ends the stream.
	Receive() (*tunnelv1.Frame, error)
	// CloseSend ends the sending side; Receive may still return frames.
	CloseSend() error
}

// ClosedError is what reading a Conn returns after the other end sent a
// Close frame: it says why the tunnel ended.
type ClosedError struct{ Reason string }

func (e *ClosedError) Error() string { return "tunnel closed: " + e.Reason }

// Conn is a net.Conn over the data frames of a tunnel: Read returns the
// bytes of the data frames received (other frames are dropped: an SSH
// tunnel carries data only), Write sends its bytes as data frames of at most
// MaxChunk, Close sends a Close frame and ends the sending side. A Close
// frame received ends reading with a *ClosedError; the end of the stream with
// io.EOF. Deadlines are not supported (they return an error).
type Conn struct {
	f    Frames
	rmu  sync.Mutex
	buf  []byte // what the last data frame left unread
	wmu  sync.Mutex
	once sync.Once
}

// NewConn returns a Conn over f.
func NewConn(f Frames) *Conn { return &Conn{f: f} }

// Read reads the data of the frames received.
func (c *Conn) Read(p []byte) (int, error) {
	c.rmu.Lock()
	defer c.rmu.Unlock()
	for len(c.buf) == 0 {
		fr, err := c.f.Receive()
		if err != nil {
			return 0, err
		}
		switch x := fr.GetFrame().(type) {
		case *tunnelv1.Frame_Data:
			c.buf = x.Data
		case *tunnelv1.Frame_Close:
			return 0, &ClosedError{Reason: x.Close.GetReason()}
		}
	}
	n := copy(p, c.buf)
	c.buf = c.buf[n:]
	return n, nil
}

// Write sends p as data frames.
func (c *Conn) Write(p []byte) (int, error) {
	c.wmu.Lock()
	defer c.wmu.Unlock()
	n := 0
	for len(p) > 0 {
		chunk := p[:min(len(p), MaxChunk)]
		// The frame may outlive the call (a buffered stream): copy.
		if err := c.f.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Data{Data: append([]byte(nil), chunk...)}}); err != nil {
			return n, err
		}
		n += len(chunk)
		p = p[len(chunk):]
	}
	return n, nil
}

// Close sends a Close frame (reason "closed") and ends the sending side;
// it is safe to call more than once.
func (c *Conn) Close() error { return c.CloseWith("closed") }

// CloseWith is Close with a reason the other end reads.
func (c *Conn) CloseWith(reason string) error {
	var err error
	c.once.Do(func() {
		c.wmu.Lock()
		defer c.wmu.Unlock()
		err = c.f.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Close{Close: &tunnelv1.Close{Reason: reason}}})
		if cerr := c.f.CloseSend(); err == nil {
			err = cerr
		}
		if errors.Is(err, io.EOF) {
			err = nil
		}
	})
	return err
}

// LocalAddr and RemoteAddr name the tunnel.
func (c *Conn) LocalAddr() net.Addr  { return addr{} }
func (c *Conn) RemoteAddr() net.Addr { return addr{} }

// errNoDeadlines is what the deadline setters return.
var errNoDeadlines = errors.New("tunnel: deadlines are not supported")

// SetDeadline is not supported.
func (c *Conn) SetDeadline(time.Time) error { return errNoDeadlines }

// SetReadDeadline is not supported.
func (c *Conn) SetReadDeadline(time.Time) error { return errNoDeadlines }

// SetWriteDeadline is not supported.
func (c *Conn) SetWriteDeadline(time.Time) error { return errNoDeadlines }

type addr struct{}

func (addr) Network() string { return "tunnel" }
func (addr) String() string  { return "tunnel" }
