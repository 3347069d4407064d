// Package inprocess_test runs the real services in this process against
// Postgres and NATS containers from the locally built images, joins
// fakedaemons in-process and follows them to adoption.
package inprocess_test

import (
	"context"
	"net/http"
	"os"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/pki"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
	"github.com/better-compute/better-compute/tests/internal/containers"
)

func TestMain(m *testing.M) {
	code := m.Run()
	containers.Stop()
	if code == 0 {
		if err := goleak.Find(goleak.IgnoreTopFunction("github.com/testcontainers/testcontainers-go.(*Reaper).connect.func1"),
			goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
			goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop"),
			goleak.IgnoreAnyFunction("internal/poll.runtime_pollWait")); err != nil {
			os.Stderr.WriteString("goleak: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}

type fixture struct {
	stack *devstack.Stack
	nodes computev1connect.NodeServiceClient
	token string
	join  string
	pool  string
}

func setup(t *testing.T) *fixture {
	t.Helper()
	dbURL := containers.Postgres(t)
	natsURL := containers.NATS(t)
	st, err := devstack.Start(t.Context(), devstack.Options{
		DatabaseURL: dbURL,
		NATSURL:     natsURL,
		PKIDir:      t.TempDir(),
	})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, st.Close()) })
	res, err := st.Bootstrap(t.Context(), devstack.BootstrapOptions{Dir: t.TempDir(), JoinMaxUses: 10})
	require.NoError(t, err)
	return &fixture{
		stack: st,
		nodes: computev1connect.NewNodeServiceClient(http.DefaultClient, st.APIURL+"/api/compute"),
		token: res.RootToken,
		join:  res.JoinToken,
		pool:  res.PoolID,
	}
}

func (f *fixture) listNodes(ctx context.Context) ([]*computev1.Node, error) {
	req := connect.NewRequest(&computev1.ListNodesRequest{PoolId: f.pool})
	req.Header().Set("Authorization", "Bearer "+f.token)
	res, err := f.nodes.ListNodes(ctx, req)
	if err != nil {
		return nil, err
	}
	return res.Msg.GetNodes(), nil
}

func (f *fixture) startDaemons(t *testing.T, n int, variant string) *fakedaemon.Runner {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	// Joins as a real daemon does: with the server's URL and the pins.
	r, err := fakedaemon.Start(ctx, fakedaemon.Config{
		Server:  f.stack.APIURL,
		Pins:    f.stack.Pins,
		Token:   f.join,
		DataDir: t.TempDir(),
		Variant: variant,
		Nodes:   n,
	}, fakedaemon.Deps{})
	require.NoError(t, err)
	t.Cleanup(func() {
		cancel()
		_ = r.Wait()
	})
	return r
}

// TestThreeFakedaemonsAreAdopted joins three simulated H100 machines to the
// real services and waits until each is adopted, has applied NodeSpec
// generation 1, and lists 8 H100 GPUs with stable UUIDs and a live session.
func TestThreeFakedaemonsAreAdopted(t *testing.T) {
	f := setup(t)
	r := f.startDaemons(t, 3, fakehw.VariantHGXH100)

	var nodes []*computev1.Node
	require.Eventually(t, func() bool {
		var err error
		nodes, err = f.listNodes(t.Context())
		if err != nil || len(nodes) != 3 {
			return false
		}
		for _, n := range nodes {
			if n.GetProvisionState() != "adopted" || n.GetObservedGeneration() < 1 {
				return false
			}
		}
		return true
	}, 60*time.Second, 200*time.Millisecond, "3 nodes adopted and generation 1 observed: %v", &nodes)

	joined := map[string]bool{}
	for _, m := range r.Machines() {
		joined[m.NodeID()] = true
	}
	uuids := map[string]bool{}
	for _, n := range nodes {
		require.True(t, joined[n.GetId()], "node %s is one of ours", n.GetId())
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
	f.startDaemons(t, 1, fakehw.VariantHGXH100GPUMissing)
	var nodes []*computev1.Node
	require.Eventually(t, func() bool {
		var err error
		nodes, err = f.listNodes(t.Context())
		return err == nil && len(nodes) == 1 && nodes[0].GetProvisionState() == "acceptance_failed"
	}, 60*time.Second, 200*time.Millisecond, "%v", &nodes)
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
	otherDir := t.TempDir()
	_, err := pki.Init(otherDir, pki.InitOptions{}, f.stack.DB.Now())
	require.NoError(t, err)
	otherPins, err := pki.ReadPins(otherDir)
	require.NoError(t, err)

	r, err := fakedaemon.New(fakedaemon.Config{
		Server: f.stack.APIURL, Pins: otherPins, Token: f.join, DataDir: t.TempDir(),
	}, fakedaemon.Deps{})
	require.NoError(t, err)
	require.ErrorContains(t, r.Run(t.Context()), "does not match the serving CA pin")

	// Keys and pins of the other deployment, at this deployment's
	// JoinService: the seal does not open.
	enc, sig, err := pki.ReadJoinPublicKeys(otherDir)
	require.NoError(t, err)
	r, err = fakedaemon.New(fakedaemon.Config{
		JoinURL: f.stack.JoinURL, JoinEncryptionKey: enc, JoinSigningKey: sig, Pins: otherPins,
		Token: f.join, DataDir: t.TempDir(),
	}, fakedaemon.Deps{})
	require.NoError(t, err)
	err = r.Run(t.Context())
	var refused *fakedaemon.JoinRefusedError
	require.ErrorAs(t, err, &refused)
	require.Equal(t, connect.CodeUnauthenticated, refused.Code)
	require.Contains(t, refused.Message, "sealed_token cannot be opened")

	var uses, nodes int
	require.NoError(t, f.stack.DB.Pool.QueryRow(t.Context(), `SELECT coalesce(sum(uses), 0) FROM join_tokens`).Scan(&uses))
	require.NoError(t, f.stack.DB.Pool.QueryRow(t.Context(), `SELECT count(*) FROM nodes`).Scan(&nodes))
	require.Zero(t, uses)
	require.Zero(t, nodes)
}
