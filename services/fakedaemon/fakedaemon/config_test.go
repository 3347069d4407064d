package fakedaemon_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	joinv1 "github.com/better-compute/better-compute/api/gen/bc/join/v1"
	"github.com/better-compute/better-compute/api/gen/bc/join/v1/joinv1connect"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

func TestNewValidatesVariant(t *testing.T) {
	_, err := fakedaemon.New(fakedaemon.Config{Variant: "dgx"}, agent.Deps{})
	require.ErrorContains(t, err, `unknown hardware variant "dgx" (valid: cpu, hgx-h100, hgx-h100-gpu-missing, l40s)`)
	// The agent's own checks still apply.
	_, err = fakedaemon.New(fakedaemon.Config{Config: agent.Config{Nodes: -1}}, agent.Deps{})
	require.ErrorContains(t, err, "nodes must be from 1 to 20000")
}

func TestNewDefaults(t *testing.T) {
	r, err := fakedaemon.New(fakedaemon.Config{}, agent.Deps{})
	require.NoError(t, err)
	require.Len(t, r.Machines(), 1)
	require.Equal(t, filepath.Join(fakedaemon.DefaultDataDir, "0"), r.Machines()[0].Dir())
}

// refusingJoin is a JoinService that keeps each request's claims and
// refuses it.
type refusingJoin struct {
	joinv1connect.UnimplementedJoinServiceHandler
	mu     sync.Mutex
	claims []*joinv1.Claims
}

func (j *refusingJoin) Join(_ context.Context, req *connect.Request[joinv1.JoinRequest]) (*connect.Response[joinv1.JoinResponse], error) {
	j.mu.Lock()
	defer j.mu.Unlock()
	j.claims = append(j.claims, req.Msg.GetClaims())
	return nil, connect.NewError(connect.CodePermissionDenied, nil)
}

// TestJoinClaims: the machines join as fakedaemon machines of the variant
// asked for (Claims), with the agent version Version and, with a seed, the
// machine ids MachineID derives from it.
func TestJoinClaims(t *testing.T) {
	pkiDir := t.TempDir()
	_, err := pki.Init(pkiDir, pki.InitOptions{}, clock.New().Now())
	require.NoError(t, err)
	pins, err := pki.ReadPins(pkiDir)
	require.NoError(t, err)
	enc, sig, err := pki.ReadJoinPublicKeys(pkiDir)
	require.NoError(t, err)
	j := &refusingJoin{}
	mux := http.NewServeMux()
	mux.Handle(joinv1connect.NewJoinServiceHandler(j))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)

	cfg := fakedaemon.Config{
		Config: agent.Config{JoinURL: srv.URL, JoinEncryptionKey: enc, JoinSigningKey: sig, Pins: pins,
			Token: "bcjt_token", DataDir: t.TempDir(), Nodes: 2, JoinOnly: true},
		Variant:       fakehw.VariantL40S,
		MachineIDSeed: "seed",
	}
	r, err := fakedaemon.New(cfg, agent.Deps{})
	require.NoError(t, err)
	require.ErrorContains(t, r.Run(t.Context()), "2 of 2 machines could not join")
	require.Len(t, j.claims, 2)
	for _, c := range j.claims {
		require.Equal(t, fakedaemon.Version, c.GetAgentVersion())
		require.Equal(t, fakehw.VariantL40S, c.GetVariant())
	}
	for i, m := range r.Machines() {
		st := m.Status()
		require.Equal(t, fakedaemon.MachineID("seed", i), st.MachineID)
		require.Equal(t, fakehw.VariantL40S, st.Variant)
	}
	require.ElementsMatch(t, []string{fakedaemon.MachineID("seed", 0), fakedaemon.MachineID("seed", 1)},
		[]string{j.claims[0].GetMachineId(), j.claims[1].GetMachineId()})
}

func TestMachineID(t *testing.T) {
	require.Equal(t, fakedaemon.MachineID("a", 1), fakedaemon.MachineID("a", 1))
	require.NotEqual(t, fakedaemon.MachineID("a", 1), fakedaemon.MachineID("a", 2))
	require.NotEqual(t, fakedaemon.MachineID("a", 1), fakedaemon.MachineID("b", 1))
	require.Regexp(t, `^[0-9a-f]{32}$`, fakedaemon.MachineID("a", 1))
}
