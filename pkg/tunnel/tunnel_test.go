package tunnel_test

import (
	"bytes"
	"crypto/ed25519"
	"crypto/rand"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	tunnelv1 "github.com/better-compute/better-compute/api/gen/bc/tunnel/v1"
	"github.com/better-compute/better-compute/pkg/tunnel"
)

func TestTicket(t *testing.T) {
	t.Parallel()
	pub, key, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	otherPub, otherKey, err := ed25519.GenerateKey(rand.Reader)
	require.NoError(t, err)
	now := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	want := tunnel.Ticket{ID: "tkt_1", NodeID: "node_1", Purpose: tunnel.PurposeSSH, TenantID: "ten_1", TokenID: "tok_1",
		ReservationID: "res_1", ExpiresAt: now.Add(tunnel.TicketTTL)}
	s, err := tunnel.Sign(key, want)
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(s, tunnel.TicketPrefix))

	got, err := tunnel.Verify(pub, s, now)
	require.NoError(t, err)
	want.Expires = want.ExpiresAt.Unix()
	require.Equal(t, want, got)

	other, err := tunnel.Sign(otherKey, want)
	require.NoError(t, err)
	for _, tc := range []struct {
		name   string
		ticket string
		pub    ed25519.PublicKey
		at     time.Time
		err    error
	}{
		{"expired", s, pub, now.Add(tunnel.TicketTTL), tunnel.ErrExpired},
		{"another key", other, pub, now, tunnel.ErrBadSignature},
		{"checked with another key", s, otherPub, now, tunnel.ErrBadSignature},
		{"tampered", tamper(s), pub, now, tunnel.ErrBadSignature},
		{"no prefix", strings.TrimPrefix(s, tunnel.TicketPrefix), pub, now, tunnel.ErrMalformed},
		{"no signature", strings.Split(s, ".")[0], pub, now, tunnel.ErrMalformed},
		{"garbage", tunnel.TicketPrefix + "!!.??", pub, now, tunnel.ErrMalformed},
		{"too long", s + strings.Repeat("A", 5000), pub, now, tunnel.ErrMalformed},
		{"empty", "", pub, now, tunnel.ErrMalformed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := tunnel.Verify(tc.pub, tc.ticket, tc.at)
			require.ErrorIs(t, err, tc.err)
		})
	}
	_, err = tunnel.Sign(key, tunnel.Ticket{ID: "tkt_2", NodeID: "node_1", Purpose: "rsh", ExpiresAt: now.Add(time.Minute)})
	require.NoError(t, err, "Sign signs what it is given")
	bad, _ := tunnel.Sign(key, tunnel.Ticket{ID: "tkt_2", NodeID: "node_1", Purpose: "rsh", ExpiresAt: now.Add(time.Minute)})
	_, err = tunnel.Verify(pub, bad, now)
	require.ErrorIs(t, err, tunnel.ErrMalformed, "an unknown purpose is refused")
}

// tamper flips one character of the ticket's body, keeping it base64.
func tamper(s string) string {
	body, sig, _ := strings.Cut(strings.TrimPrefix(s, tunnel.TicketPrefix), ".")
	b := []byte(body)
	if b[10] == 'A' {
		b[10] = 'B'
	} else {
		b[10] = 'A'
	}
	return tunnel.TicketPrefix + string(b) + "." + sig
}

// pipe is one end of an in-memory frame stream.
type pipe struct {
	in  <-chan *tunnelv1.Frame
	out chan<- *tunnelv1.Frame
}

func (p pipe) Send(f *tunnelv1.Frame) error { p.out <- f; return nil }

func (p pipe) Receive() (*tunnelv1.Frame, error) {
	f, ok := <-p.in
	if !ok {
		return nil, io.EOF
	}
	return f, nil
}

func (p pipe) CloseSend() error { close(p.out); return nil }

func pipes() (pipe, pipe) {
	a, b := make(chan *tunnelv1.Frame, 64), make(chan *tunnelv1.Frame, 64)
	return pipe{in: a, out: b}, pipe{in: b, out: a}
}

func TestConn(t *testing.T) {
	t.Parallel()
	left, right := pipes()
	a, b := tunnel.NewConn(left), tunnel.NewConn(right)
	msg := bytes.Repeat([]byte("0123456789abcdef"), 5000) // 80,000 bytes: three frames
	errc := make(chan error, 1)
	go func() {
		_, err := a.Write(msg)
		errc <- err
	}()
	got := make([]byte, len(msg))
	_, err := io.ReadFull(b, got)
	require.NoError(t, err)
	require.NoError(t, <-errc)
	require.Equal(t, msg, got)

	// Frames other than data are not the byte stream's.
	require.NoError(t, left.Send(&tunnelv1.Frame{Frame: &tunnelv1.Frame_Resize{Resize: &tunnelv1.TerminalSize{Rows: 1, Cols: 1}}}))
	_, err = a.Write([]byte("x"))
	require.NoError(t, err)
	one := make([]byte, 8)
	n, err := b.Read(one)
	require.NoError(t, err)
	require.Equal(t, "x", string(one[:n]))

	require.NoError(t, a.CloseWith("the node was revoked"))
	require.NoError(t, a.Close(), "closing twice is fine")
	_, err = b.Read(one)
	var closed *tunnel.ClosedError
	require.True(t, errors.As(err, &closed), "%v", err)
	require.Equal(t, "the node was revoked", closed.Reason)
}

// TestTerm: Resize signals Resized once per pending change and only when
// the size changed; Size follows it.
func TestTerm(t *testing.T) {
	t.Parallel()
	var out bytes.Buffer
	term := tunnel.NewTerm(strings.NewReader("in"), &out, tunnel.Size{Rows: 24, Cols: 80})
	require.Equal(t, tunnel.Size{Rows: 24, Cols: 80}, term.Size())
	term.Resize(tunnel.Size{Rows: 24, Cols: 80})
	require.Empty(t, term.Resized(), "no change, no signal")
	term.Resize(tunnel.Size{Rows: 30, Cols: 100})
	term.Resize(tunnel.Size{Rows: 40, Cols: 120}) // coalesced with the last
	require.Len(t, term.Resized(), 1)
	<-term.Resized()
	require.Equal(t, tunnel.Size{Rows: 40, Cols: 120}, term.Size())
	b, err := io.ReadAll(term)
	require.NoError(t, err)
	require.Equal(t, "in", string(b))
	_, err = term.Write([]byte("out"))
	require.NoError(t, err)
	require.Equal(t, "out", out.String())
}
