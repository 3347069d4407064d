// Package inprocess_test runs the real services in this process on an
// embedded PostgreSQL and NATS (pkg/devstack), joins simulated machines
// (fakedaemons) in-process and follows them to adoption.
package inprocess_test

import (
	"context"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// http.DefaultClient's idle connections to the stopped servers.
		goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop"),
	)
}

// realClock measures how long things take.
var realClock = clock.New()

// joinWithin bounds how long machines may take to join, and then to be
// adopted, in these tests: a deadline for a hang, not a speed target.
const joinWithin = 60 * time.Second

type fixture struct {
	stack *devstack.Stack
	nodes computev1connect.NodeServiceClient
	pool  string
}

// setup starts a throwaway stack (embedded PostgreSQL and NATS), closed at
// the end of the test, with a pool accepting machines of 8 H100s.
func setup(t *testing.T) *fixture {
	t.Helper()
	return setupWith(t, devstack.Options{})
}

// setupWith is setup with the stack options o.
func setupWith(t *testing.T, o devstack.Options) *fixture {
	t.Helper()
	st, err := devstack.Start(t.Context(), o)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, st.Close()) })
	pool, err := st.CreatePool(t.Context(), devstack.PoolOptions{GPUModel: "H100", ExpectGPUs: 8})
	require.NoError(t, err)
	return &fixture{
		stack: st,
		nodes: computev1connect.NewNodeServiceClient(http.DefaultClient, st.APIURL+"/api/compute", st.ClientOptions()...),
		pool:  pool,
	}
}

func (f *fixture) listNodes(ctx context.Context) ([]*computev1.Node, error) {
	res, err := f.nodes.ListNodes(ctx, connect.NewRequest(&computev1.ListNodesRequest{PoolId: f.pool}))
	if err != nil {
		return nil, err
	}
	return res.Msg.GetNodes(), nil
}

// join runs o.Count simulated machines (default 1) in the fixture's pool
// through the stack's Join and returns their node ids once they joined and
// their nodes are in state (WaitFor: adopted includes NodeSpec generation 1
// or later applied), each within joinWithin.
func (f *fixture) join(t *testing.T, o devstack.JoinOptions, state string) []string {
	t.Helper()
	o.Pool, o.Timeout = f.pool, joinWithin
	ids, err := f.stack.Join(t.Context(), o)
	require.NoError(t, err)
	_, err = f.stack.WaitFor(t.Context(), ids, devstack.WaitOptions{State: state, Timeout: joinWithin})
	require.NoError(t, err)
	return ids
}

// joinToken mints a join token of the fixture's pool, for machines a test
// runs itself (fakedaemon.Start) instead of through join.
func (f *fixture) joinToken(t *testing.T) string {
	t.Helper()
	secret, err := f.stack.JoinToken(t.Context(), f.pool, 10)
	require.NoError(t, err)
	return secret
}

// TestThreeFakedaemonsAreAdopted joins three simulated H100 machines to the
// real services and waits until each is adopted, has applied NodeSpec
// generation 1, and lists 8 H100 GPUs with stable UUIDs and a live session.
func TestThreeFakedaemonsAreAdopted(t *testing.T) {
	f := setup(t)
	ids := f.join(t, devstack.JoinOptions{Count: 3, Variant: fakehw.VariantHGXH100}, store.NodeAdopted)

	nodes, err := f.listNodes(t.Context())
	require.NoError(t, err)
	require.Len(t, nodes, 3)
	uuids := map[string]bool{}
	for _, n := range nodes {
		require.Contains(t, ids, n.GetId(), "node %s is one of ours", n.GetId())
		require.Equal(t, "adopted", n.GetProvisionState())
		require.GreaterOrEqual(t, n.GetObservedGeneration(), int64(1))
		require.Equal(t, int64(1), n.GetSpecGeneration())
		require.Len(t, n.GetGpus(), 8)
		require.Contains(t, n.GetGpuModel(), "H100")
		require.True(t, n.GetReachable())
		require.Equal(t, f.stack.Gateways[0].GatewayID(), n.GetGatewayId())
		require.NotNil(t, n.GetLastSeen())
		for _, g := range n.GetGpus() {
			require.False(t, uuids[g.GetUuid()], "GPU UUID %s is unique", g.GetUuid())
			uuids[g.GetUuid()] = true
		}
	}
}

// TestGPUMissingIsNeverAdopted joins a machine with a GPU missing: it passes
// through acceptance to acceptance_failed with the reason, and stays there,
// showing the GPUs it reported.
func TestGPUMissingIsNeverAdopted(t *testing.T) {
	f := setup(t)
	ids := f.join(t, devstack.JoinOptions{Variant: fakehw.VariantHGXH100GPUMissing}, store.NodeAcceptanceFailed)
	nodes, err := f.listNodes(t.Context())
	require.NoError(t, err)
	require.Len(t, nodes, 1)
	require.Equal(t, ids[0], nodes[0].GetId())
	require.Equal(t, "acceptance_failed", nodes[0].GetProvisionState())
	require.Equal(t, "expected 8 GPUs, found 7", nodes[0].GetProvisionReason())
	require.Zero(t, nodes[0].GetSpecGeneration(), "never adopted: no NodeSpec")
	require.Len(t, nodes[0].GetGpus(), 7, "the GPUs diag.nvml reported are shown")
	require.Contains(t, nodes[0].GetGpuModel(), "H100")
}

// TestJoinWithAnotherDeploymentsPinsConsumesNothing: a machine pinned to
// another deployment refuses the well-known document's keys before it sends
// anything, and a token sealed to another deployment's key is refused by
// JoinService; neither uses the join token.
func TestJoinWithAnotherDeploymentsPinsConsumesNothing(t *testing.T) {
	f := setup(t)
	token := f.joinToken(t)
	otherDir := t.TempDir()
	_, err := pki.Init(otherDir, pki.InitOptions{}, f.stack.DB.Now())
	require.NoError(t, err)
	otherPins, err := pki.ReadPins(otherDir)
	require.NoError(t, err)

	r, err := fakedaemon.New(fakedaemon.Config{Config: agent.Config{
		Server: f.stack.APIURL, Pins: otherPins, Token: token, DataDir: t.TempDir(),
	}}, agent.Deps{})
	require.NoError(t, err)
	require.ErrorContains(t, r.Run(t.Context()), "does not match the serving CA pin")

	// Keys and pins of the other deployment, at this deployment's
	// JoinService: the seal does not open.
	enc, sig, err := pki.ReadJoinPublicKeys(otherDir)
	require.NoError(t, err)
	r, err = fakedaemon.New(fakedaemon.Config{Config: agent.Config{
		JoinURL: f.stack.JoinURL, JoinEncryptionKey: enc, JoinSigningKey: sig, Pins: otherPins,
		Token: token, DataDir: t.TempDir(),
	}}, agent.Deps{})
	require.NoError(t, err)
	err = r.Run(t.Context())
	var refused *agent.JoinRefusedError
	require.ErrorAs(t, err, &refused)
	require.Equal(t, connect.CodeUnauthenticated, refused.Code)
	require.Contains(t, refused.Message, "sealed_token cannot be opened")

	var uses, nodes int
	require.NoError(t, f.stack.DB.Pool.QueryRow(t.Context(), `SELECT coalesce(sum(uses), 0) FROM join_tokens`).Scan(&uses))
	require.NoError(t, f.stack.DB.Pool.QueryRow(t.Context(), `SELECT count(*) FROM nodes`).Scan(&nodes))
	require.Zero(t, uses)
	require.Zero(t, nodes)
}
