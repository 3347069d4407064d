package devstack_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/devstack"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/store"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// http.DefaultClient's idle connections to the stopped servers.
		goleak.IgnoreAnyFunction("net/http.(*persistConn).readLoop"),
		goleak.IgnoreAnyFunction("net/http.(*persistConn).writeLoop"),
		goleak.IgnoreAnyFunction("internal/poll.runtime_pollWait"),
	)
}

// start runs a throwaway stack (embedded Postgres in memory, embedded NATS)
// closed at the end of the test.
func start(t *testing.T, o devstack.Options) *devstack.Stack {
	t.Helper()
	st, err := devstack.Start(t.Context(), o)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, st.Close()) })
	return st
}

// The documentation's example: three simulated machines join a pool that
// expects 8 GPUs and are adopted.
func ExampleStack() {
	ctx := context.Background()
	st, err := devstack.Start(ctx, devstack.Options{}) // embedded Postgres and NATS
	if err != nil {
		panic(err)
	}
	defer st.Close()
	pool, err := st.CreatePool(ctx, devstack.PoolOptions{GPUModel: "H100", ExpectGPUs: 8})
	if err != nil {
		panic(err)
	}
	nodes, err := st.Join(ctx, devstack.JoinOptions{Pool: pool, Count: 3}) // sealed-token Join, then a Session each
	if err != nil {
		panic(err)
	}
	if _, err := st.WaitFor(ctx, nodes, devstack.WaitOptions{}); err != nil { // adopted, NodeSpec generation ≥ 1 applied
		panic(err)
	}
	fmt.Println(len(st.Daemons()), "daemons adopted")
	// Output: 3 daemons adopted
}

// TestAdoptsThreeSimulatedMachines is the example with what it implies
// checked: the nodes are the machines', adopted with 8 H100s each, their
// NodeSpec applied, on the stack's gateway.
func TestAdoptsThreeSimulatedMachines(t *testing.T) {
	t.Parallel()
	st := start(t, devstack.Options{})
	ctx := t.Context()
	pool, err := st.CreatePool(ctx, devstack.PoolOptions{GPUModel: "H100", ExpectGPUs: 8})
	require.NoError(t, err)
	nodes, err := st.Join(ctx, devstack.JoinOptions{Pool: pool, Count: 3})
	require.NoError(t, err)
	require.Len(t, nodes, 3)
	statuses, err := st.WaitFor(ctx, nodes, devstack.WaitOptions{})
	require.NoError(t, err)
	for i, s := range statuses {
		require.Equal(t, nodes[i], s.ID)
		require.Equal(t, store.NodeAdopted, s.ProvisionState)
		require.GreaterOrEqual(t, s.ObservedGeneration, int64(1))
	}
	daemons := st.Daemons()
	require.Len(t, daemons, 3)
	for i, d := range daemons {
		require.Equal(t, nodes[i], d.NodeID())
		require.GreaterOrEqual(t, d.Status().ObservedGeneration, int64(1))
		require.Equal(t, st.Gateways[0].GatewayID(), d.Status().GatewayID)
	}
	var gpus int
	require.NoError(t, st.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM node_devices d JOIN nodes n ON n.id = d.node_id
		WHERE n.pool_id = $1 AND d.model LIKE '%H100%'`, pool).Scan(&gpus))
	require.Equal(t, 24, gpus)
}

// TestGPUMissingFailsAcceptance: WaitFor adopted fails as soon as a node
// failed acceptance, naming the reason; waiting for acceptance_failed
// succeeds.
func TestGPUMissingFailsAcceptance(t *testing.T) {
	t.Parallel()
	st := start(t, devstack.Options{})
	ctx := t.Context()
	po, err := devstack.VariantPool(fakehw.VariantHGXH100GPUMissing)
	require.NoError(t, err)
	pool, err := st.CreatePool(ctx, po)
	require.NoError(t, err)
	nodes, err := st.Join(ctx, devstack.JoinOptions{Pool: pool, Count: 2, Variant: fakehw.VariantHGXH100GPUMissing})
	require.NoError(t, err)
	_, err = st.WaitFor(ctx, nodes, devstack.WaitOptions{})
	require.ErrorContains(t, err, "failed acceptance: expected 8 GPUs, found 7")
	statuses, err := st.WaitFor(ctx, nodes, devstack.WaitOptions{State: store.NodeAcceptanceFailed})
	require.NoError(t, err)
	for _, s := range statuses {
		require.Equal(t, "expected 8 GPUs, found 7", s.ProvisionReason)
	}
}

// TestKeptDataDir: a second stack on the same DataDir has the same root
// token, pool and nodes; its machines come back without joining again.
func TestKeptDataDir(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	ctx := t.Context()
	run := func() (token, pool string, nodes []string, joinTokens int) {
		st, err := devstack.Start(ctx, devstack.Options{DataDir: dir})
		require.NoError(t, err)
		defer func() { require.NoError(t, st.Close()) }()
		po, err := devstack.VariantPool(fakehw.VariantL40S)
		require.NoError(t, err)
		pool, err = st.CreatePool(ctx, po)
		require.NoError(t, err)
		nodes, err = st.Join(ctx, devstack.JoinOptions{Pool: pool, Count: 2, Variant: fakehw.VariantL40S, Seed: "kept"})
		require.NoError(t, err)
		_, err = st.WaitFor(ctx, nodes, devstack.WaitOptions{})
		require.NoError(t, err)
		require.NoError(t, st.DB.Pool.QueryRow(ctx, `SELECT count(*) FROM join_tokens`).Scan(&joinTokens))
		return st.RootToken, pool, nodes, joinTokens
	}
	token1, pool1, nodes1, tokens1 := run()
	token2, pool2, nodes2, tokens2 := run()
	require.Equal(t, token1, token2, "the root token is kept")
	require.Equal(t, pool1, pool2, "the pool is found by name")
	require.Equal(t, nodes1, nodes2, "the machines come back as the same nodes")
	require.Equal(t, 1, tokens1)
	require.Equal(t, tokens1, tokens2, "no join token is minted for machines that joined before")
	for _, name := range []string{devstack.DirPostgres, devstack.DirPKI, devstack.DirServicePKI, devstack.FileSecret, devstack.FileRootEnv} {
		st, err := os.Stat(dir + "/" + name)
		require.NoError(t, err, name)
		require.Zero(t, st.Mode().Perm()&0o077, "%s is owner-only", name)
	}
}

// TestCloseStopsEverything: after Close the embedded PostgreSQL server is
// gone and the throwaway directory removed.
func TestCloseStopsEverything(t *testing.T) {
	t.Parallel()
	st, err := devstack.Start(t.Context(), devstack.Options{})
	require.NoError(t, err)
	pid, dir := st.Postgres.PID(), st.DataDir()
	require.NoError(t, syscall.Kill(pid, 0), "the server runs")
	require.NoError(t, st.Close())
	require.NoError(t, st.Close(), "a second Close does nothing")
	require.ErrorIs(t, syscall.Kill(pid, 0), syscall.ESRCH, "the server is gone")
	_, err = os.Stat(dir)
	require.ErrorIs(t, err, os.ErrNotExist)
	_, err = st.Join(t.Context(), devstack.JoinOptions{Pool: "pool_x"})
	require.ErrorContains(t, err, "closed")
}

// TestBadInput: Join and CreatePool refuse what cannot work, saying why.
func TestBadInput(t *testing.T) {
	t.Parallel()
	st := start(t, devstack.Options{})
	ctx := t.Context()
	pool, err := st.CreatePool(ctx, devstack.PoolOptions{Name: "gpus", GPUModel: "H100", ExpectGPUs: 8})
	require.NoError(t, err)
	again, err := st.CreatePool(ctx, devstack.PoolOptions{Name: "gpus", GPUModel: "H100", ExpectGPUs: 8})
	require.NoError(t, err)
	require.Equal(t, pool, again)
	_, err = st.CreatePool(ctx, devstack.PoolOptions{Name: "gpus", GPUModel: "L40S", ExpectGPUs: 4})
	require.ErrorContains(t, err, `accepts GPU model "H100" × 8`)
	_, err = st.Join(ctx, devstack.JoinOptions{Pool: pool, Count: devstack.MaxJoin + 1})
	require.ErrorContains(t, err, "count must be from 1 to 10000")
	_, err = st.Join(ctx, devstack.JoinOptions{})
	require.ErrorContains(t, err, "a pool is required")
	_, err = st.Join(ctx, devstack.JoinOptions{Pool: pool, Variant: "tpu"})
	require.ErrorContains(t, err, `unknown hardware variant "tpu"`)
	_, err = st.WaitFor(ctx, []string{"node_missing"}, devstack.WaitOptions{})
	require.ErrorContains(t, err, "node node_missing does not exist")
	_, err = devstack.VariantPool("tpu")
	require.ErrorContains(t, err, `unknown hardware variant "tpu"`)
}

// TestThrowawaysOfKilledStacksAreSwept: a throwaway DataDir whose stack
// died without Close (its lock free) is removed by the next Start; one whose
// lock is held stays.
func TestThrowawaysOfKilledStacksAreSwept(t *testing.T) {
	t.Parallel()
	mk := func() (string, *os.File) {
		dir, err := os.MkdirTemp("", "bc-devstack-")
		require.NoError(t, err)
		t.Cleanup(func() { _ = os.RemoveAll(dir) })
		f, err := os.Create(filepath.Join(dir, ".lock"))
		require.NoError(t, err)
		t.Cleanup(func() { f.Close() })
		return dir, f
	}
	dead, deadLock := mk()
	require.NoError(t, deadLock.Close())
	live, liveLock := mk()
	require.NoError(t, syscall.Flock(int(liveLock.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))
	start(t, devstack.Options{})
	_, err := os.Stat(dead)
	require.ErrorIs(t, err, os.ErrNotExist, "the dead stack's directory is removed")
	_, err = os.Stat(live)
	require.NoError(t, err, "a live stack's directory stays")
}

// TestDataDirIsOneStacks: a second stack on a DataDir in use is refused
// and changes nothing of it, also when both start at once on a new one.
func TestDataDirIsOneStacks(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	dir := filepath.Join(t.TempDir(), "new", "data")
	type outcome struct {
		st  *devstack.Stack
		err error
	}
	results := make(chan outcome, 2)
	for range 2 {
		go func() {
			st, err := devstack.Start(ctx, devstack.Options{DataDir: dir})
			results <- outcome{st, err}
		}()
	}
	var winner *devstack.Stack
	var refused error
	for range 2 {
		r := <-results
		if r.err == nil {
			require.Nil(t, winner, "only one stack starts")
			winner = r.st
		} else {
			refused = r.err
		}
	}
	require.NotNil(t, winner)
	t.Cleanup(func() { require.NoError(t, winner.Close()) })
	require.ErrorIs(t, refused, devstack.ErrDataDirInUse)
	require.ErrorContains(t, refused, "data directory "+dir+" is in use by another better-compute dev stack (pid ")
	_, err := devstack.Start(ctx, devstack.Options{DataDir: dir})
	require.ErrorIs(t, err, devstack.ErrDataDirInUse)
	_, err = winner.CreatePool(ctx, devstack.PoolOptions{Name: "still-works"})
	require.NoError(t, err, "the refused starts left the winner's data alone")
}

// TestDataDirThatIsNotOurs: a file, or a directory of other files, is
// refused and left as it was.
func TestDataDirThatIsNotOurs(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	dir := t.TempDir()
	photos := filepath.Join(dir, "photos")
	require.NoError(t, os.Mkdir(photos, 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(photos, "cat.jpg"), []byte("meow"), 0o644))
	_, err := devstack.Start(ctx, devstack.Options{DataDir: photos})
	require.ErrorIs(t, err, devstack.ErrNotDataDir)
	require.ErrorContains(t, err, "data directory "+photos+" holds files that are not a better-compute dev stack's")
	entries, err := os.ReadDir(photos)
	require.NoError(t, err)
	require.Len(t, entries, 1, "nothing added")

	dangling := filepath.Join(dir, "dangling")
	require.NoError(t, os.Symlink(filepath.Join(dir, "nowhere"), dangling))
	_, err = devstack.Start(ctx, devstack.Options{DataDir: dangling})
	require.ErrorIs(t, err, devstack.ErrNotDataDir)
	require.ErrorContains(t, err, "is a symbolic link to nothing")

	file := filepath.Join(dir, "file")
	require.NoError(t, os.WriteFile(file, nil, 0o600))
	_, err = devstack.Start(ctx, devstack.Options{DataDir: file})
	require.ErrorIs(t, err, devstack.ErrNotDataDir)
	require.ErrorContains(t, err, "is not a directory")
}

// TestFailedStartLeavesNoDataDir: a Start that fails after making its
// DataDir removes it (and the parents it made); an empty directory it was
// given is left empty.
func TestFailedStartLeavesNoDataDir(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	base := t.TempDir()
	noBinaries := t.TempDir()
	_, err := devstack.Start(ctx, devstack.Options{DataDir: filepath.Join(base, "a", "b"), PostgresBinDir: noBinaries})
	require.ErrorContains(t, err, "initdb")
	entries, err := os.ReadDir(base)
	require.NoError(t, err)
	require.Empty(t, entries)

	empty := filepath.Join(base, "empty")
	require.NoError(t, os.Mkdir(empty, 0o700))
	_, err = devstack.Start(ctx, devstack.Options{DataDir: empty, PostgresBinDir: noBinaries})
	require.Error(t, err)
	entries, err = os.ReadDir(empty)
	require.NoError(t, err)
	require.Empty(t, entries)
}

// TestTwoStacksOnOneDatabase: stacks of two DataDirs on one database take
// gateway ids and lease holders of their own, and both serve.
func TestTwoStacksOnOneDatabase(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	one := start(t, devstack.Options{DataDir: t.TempDir()})
	two := start(t, devstack.Options{DataDir: t.TempDir(), DatabaseURL: one.DatabaseURL})
	require.NotEqual(t, one.Gateways[0].GatewayID(), two.Gateways[0].GatewayID())
	require.NotEqual(t, one.Instance, two.Instance)
	holders := func() []string {
		rows, err := one.DB.Pool.Query(ctx, `SELECT DISTINCT holder FROM leases ORDER BY 1`)
		require.NoError(t, err)
		hs, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return hs
	}
	// Each gateway records its presence at its first last_seen flush.
	gateways := []string{one.Gateways[0].GatewayID(), two.Gateways[0].GatewayID()}
	require.Eventually(t, func() bool {
		hs := holders()
		return slices.Contains(hs, gateways[0]) && slices.Contains(hs, gateways[1])
	}, 10*time.Second, 20*time.Millisecond, "both gateways' presence")
	for _, h := range holders() {
		require.True(t, strings.Contains(h, "-"+one.Instance+"-") || strings.Contains(h, "-"+two.Instance+"-"),
			"lease holder %s is one of the two stacks'", h)
	}
	_, err := two.CreatePool(ctx, devstack.PoolOptions{Name: "second"})
	require.NoError(t, err)
}

// TestUnreachableNATSIsRefused: a NATS server that does not answer fails
// Start at once, naming it.
func TestUnreachableNATSIsRefused(t *testing.T) {
	t.Parallel()
	_, err := devstack.Start(t.Context(), devstack.Options{NATSURL: "nats://127.0.0.1:1"})
	require.ErrorContains(t, err, "nats://127.0.0.1:1")
}

// TestTakenGatewayPortIsAWarning: a kept stack whose gateway port is taken
// at the next run listens on another, says so, and its machines still come
// back.
func TestTakenGatewayPortIsAWarning(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	dir := t.TempDir()
	st, err := devstack.Start(ctx, devstack.Options{DataDir: dir})
	require.NoError(t, err)
	pool, err := st.CreatePool(ctx, devstack.PoolOptions{Name: "moved"})
	require.NoError(t, err)
	nodes, err := st.Join(ctx, devstack.JoinOptions{Pool: pool, Variant: fakehw.VariantCPU})
	require.NoError(t, err)
	_, err = st.WaitFor(ctx, nodes, devstack.WaitOptions{})
	require.NoError(t, err)
	gw := st.GatewayURL()
	require.Empty(t, st.Warnings)
	require.NoError(t, st.Close())

	taken, err := net.Listen("tcp", strings.TrimPrefix(gw, "https://"))
	require.NoError(t, err)
	defer taken.Close()
	st = start(t, devstack.Options{DataDir: dir})
	require.NotEqual(t, gw, st.GatewayURL())
	require.Len(t, st.Warnings, 1)
	require.Contains(t, st.Warnings[0], "the gateway 0's port")
	again, err := st.Join(ctx, devstack.JoinOptions{Pool: pool, Variant: fakehw.VariantCPU})
	require.NoError(t, err)
	require.Equal(t, nodes, again)
	_, err = st.WaitFor(ctx, again, devstack.WaitOptions{})
	require.NoError(t, err)
}

// TestWaitForConnected: after a restart on kept data the nodes are adopted
// in the database at once; Connected waits for their machines' sessions,
// and fails at once for a machine whose node was revoked meanwhile.
func TestWaitForConnected(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	dir := t.TempDir()
	run := func(revoke bool) (*devstack.Stack, []string, error) {
		st := start(t, devstack.Options{DataDir: dir})
		pool, err := st.CreatePool(ctx, devstack.PoolOptions{Name: "revoked"})
		require.NoError(t, err)
		nodes, err := st.Join(ctx, devstack.JoinOptions{Pool: pool, Count: 2, Variant: fakehw.VariantCPU})
		require.NoError(t, err)
		_, err = st.WaitFor(ctx, nodes, devstack.WaitOptions{Connected: true})
		if err == nil {
			for _, m := range st.Daemons() {
				require.NotEmpty(t, m.Status().SessionID, "connected in this run")
			}
		}
		if revoke {
			_, rerr := computev1connect.NewNodeServiceClient(http.DefaultClient, st.APIURL+"/api/compute", st.ClientOptions()...).
				RevokeNode(ctx, connect.NewRequest(&computev1.RevokeNodeRequest{NodeId: nodes[0], Reason: "test"}))
			require.NoError(t, rerr)
		}
		require.NoError(t, st.Close())
		return st, nodes, err
	}
	_, nodes, err := run(false)
	require.NoError(t, err)
	_, again, err := run(true)
	require.NoError(t, err, "a restart waits for the sessions of this run")
	require.Equal(t, nodes, again)
	_, _, err = run(false)
	require.ErrorContains(t, err, "node "+nodes[0]+"'s machine stopped for good")

	st := start(t, devstack.Options{})
	_, err = st.WaitFor(ctx, []string{"node_elsewhere"}, devstack.WaitOptions{Connected: true})
	require.ErrorContains(t, err, "is not a machine of this stack's")
}
