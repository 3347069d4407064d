package gateway

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
)

// TestCloseReason: each way a session ends has its label value, from the
// errors the handler ends with.
func TestCloseReason(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		err  error
		want string
	}{
		{nil, "closed"},
		{io.EOF, "closed"},
		{context.Canceled, "closed"},
		{connect.NewError(connect.CodeCanceled, errors.New("client went away")), "closed"},
		{errSuperseded, "superseded"},
		{fmt.Errorf("abort: %w", errSuperseded), "superseded"},
		{errSilent, "silent"},
		{errNoHello, "silent"},
		{errRevoked, "revoked"},
		{expiredSession(), "cert_expired"},
		{connect.NewError(connect.CodeInvalidArgument, errors.New("heartbeat.seq: must be positive")), "invalid"},
		{errShuttingDown, "shutdown"},
		{errFenced, "unavailable"},
		{errPendingWork, "unavailable"},
		{errRecord, "unavailable"},
		{errors.New("something else"), "other"},
	} {
		t.Run(fmt.Sprint(c.err), func(t *testing.T) {
			t.Parallel()
			require.Equal(t, c.want, closeReasons[closeReason(c.err)])
		})
	}
}

// expiredSession is the error that ends a session whose certificate
// expired.
func expiredSession() error {
	st := &session{}
	st.cert.Store(&sessionCert{notAfter: time.Unix(0, 0)})
	return st.expired(time.Unix(1, 0))
}
