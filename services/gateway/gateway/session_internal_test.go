package gateway

import (
	"bytes"
	"errors"
	"io"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/require"
)

// TestSessionBody checks that a read ahead (fill) changes nothing of what
// a Session stream's body returns: every byte in order, then the error that
// ended it, whatever the sizes of the reads.
func TestSessionBody(t *testing.T) {
	t.Parallel()
	data := bytes.Repeat([]byte("0123456789abcdef"), 40) // longer than head
	errBroken := errors.New("stream reset")
	for _, tc := range []struct {
		name string
		end  error // what the body returns after data
		want error // what reading the sessionBody to its end returns
	}{
		{name: "eof", end: io.EOF, want: nil},
		{name: "reset", end: errBroken, want: errBroken},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			for _, step := range []int{1, 5, 7, 64, 100, 1000} {
				src := io.MultiReader(iotest.OneByteReader(bytes.NewReader(data[:3])), bytes.NewReader(data[3:]), iotest.ErrReader(tc.end))
				b := &sessionBody{rc: io.NopCloser(src)}
				var got []byte
				var err error
				for err == nil {
					b.fill()
					p := make([]byte, step)
					var n int
					n, err = b.Read(p)
					got = append(got, p[:n]...)
				}
				if errors.Is(err, io.EOF) {
					err = nil
				}
				require.Equal(t, string(data), string(got), "reads of %d", step)
				require.ErrorIs(t, err, tc.want, "reads of %d", step)
				// The error stays.
				b.fill()
				_, again := b.Read(make([]byte, 1))
				require.ErrorIs(t, again, tc.end)
			}
		})
	}
}

// TestSessionBodyFillWithoutBody checks that fill does nothing for a
// session whose body is not a sessionBody's (no Session request).
func TestSessionBodyFillWithoutBody(t *testing.T) {
	t.Parallel()
	var b sessionBody
	b.fill()
	require.Zero(t, b.w)
}
