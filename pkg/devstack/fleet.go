package devstack

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	computev1 "github.com/better-compute/better-compute/api/gen/bc/compute/v1"
	"github.com/better-compute/better-compute/api/gen/bc/compute/v1/computev1connect"
	"github.com/better-compute/better-compute/pkg/agent"
	"github.com/better-compute/better-compute/pkg/clock"
	"github.com/better-compute/better-compute/pkg/fakehw"
	"github.com/better-compute/better-compute/pkg/store"
	"github.com/better-compute/better-compute/services/fakedaemon/fakedaemon"
)

// The site every pool of CreatePool is in.
const (
	SiteName   = "dev-1"
	SiteRegion = "dev-1"
)

// MaxJoin is the most machines one Join runs (JoinOptions.Count).
const MaxJoin = 10000

// fleet is the simulated machines the stack runs.
type fleet struct {
	mu      sync.Mutex
	runners []*joined
	dirs    map[string]bool // machine directories taken by this run's Joins
	closed  bool
}

// joined is one Join's machines.
type joined struct {
	runner *agent.Runner
	cancel context.CancelFunc
}

// reserveDir returns base, or base-<k> for the smallest k > 0 that no Join
// of this run has taken, and takes it.
func (f *fleet) reserveDir(base string) (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return "", errors.New("devstack: join: the stack is closed")
	}
	if f.dirs == nil {
		f.dirs = map[string]bool{}
	}
	dir := base
	for k := 1; f.dirs[dir]; k++ {
		dir = base + "-" + strconv.Itoa(k)
	}
	f.dirs[dir] = true
	return dir, nil
}

// add records a started Join's machines, unless the stack closed meanwhile.
func (f *fleet) add(j *joined) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return errors.New("devstack: join: the stack is closed")
	}
	f.runners = append(f.runners, j)
	return nil
}

// stop stops every machine and waits for them; later Joins fail.
func (f *fleet) stop() {
	f.mu.Lock()
	f.closed = true
	runners := f.runners
	f.mu.Unlock()
	for _, j := range runners {
		j.cancel()
	}
	for _, j := range runners {
		_ = j.runner.Wait()
	}
}

// bearer sets the Authorization header on every request.
type bearer string

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}

func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		conn.RequestHeader().Set("Authorization", "Bearer "+string(b))
		return conn
	}
}

func (b bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// ClientOptions are the Connect options of a client acting as the root
// administrator: they send RootToken.
func (s *Stack) ClientOptions() []connect.ClientOption {
	return []connect.ClientOption{connect.WithInterceptors(bearer(s.RootToken))}
}

func (s *Stack) pools() computev1connect.PoolServiceClient {
	return computev1connect.NewPoolServiceClient(http.DefaultClient, s.APIURL+"/api/compute", s.ClientOptions()...)
}

// PoolOptions say what pool CreatePool makes.
type PoolOptions struct {
	// Name is the pool's name (lower-case letters, digits and dashes). A
	// pool of the root tenant with this name in site dev-1 is returned as
	// it is when its acceptance matches; empty: "pool-<n>", a name no pool
	// has yet.
	Name string
	// GPUModel, when set, must be a substring of every GPU's model name for
	// a node to be adopted (e.g. "H100").
	GPUModel string
	// ExpectGPUs, when positive, is the exact GPU count a node must have.
	ExpectGPUs int32
}

// VariantPool returns the pool options that fit a fakehw variant (the pools
// of `better-compute dev --sim`): hgx-h100 and hgx-h100-gpu-missing model
// H100 and 8 GPUs, l40s L40S and 4, cpu no model and no count; the name is
// "sim-<variant>". It fails for an unknown variant.
func VariantPool(variant string) (PoolOptions, error) {
	o := PoolOptions{Name: "sim-" + variant}
	switch variant {
	case fakehw.VariantHGXH100, fakehw.VariantHGXH100GPUMissing:
		o.GPUModel, o.ExpectGPUs = "H100", 8
	case fakehw.VariantL40S:
		o.GPUModel, o.ExpectGPUs = "L40S", 4
	case fakehw.VariantCPU:
	default:
		return o, fmt.Errorf("unknown hardware variant %q (valid: %s)", variant, strings.Join(fakehw.Variants(), ", "))
	}
	return o, nil
}

// CreatePool makes a metal-host pool with diag.nvml acceptance in site dev-1
// (region dev-1, made when missing) as the root administrator, through the
// API, and returns its id. A pool named o.Name that exists already is
// returned when its acceptance is o's, and is an error otherwise.
func (s *Stack) CreatePool(ctx context.Context, o PoolOptions) (string, error) {
	pools := s.pools()
	siteID, err := s.ensureSite(ctx, pools)
	if err != nil {
		return "", err
	}
	list, err := pools.ListPools(ctx, connect.NewRequest(&computev1.ListPoolsRequest{SiteId: siteID}))
	if err != nil {
		return "", fmt.Errorf("devstack: list pools: %w", err)
	}
	names := map[string]*computev1.Pool{}
	for _, p := range list.Msg.GetPools() {
		if p.GetOwnerTenantId() == s.TenantID {
			names[p.GetName()] = p
		}
	}
	if o.Name == "" {
		for n := len(names) + 1; ; n++ {
			if o.Name = "pool-" + strconv.Itoa(n); names[o.Name] == nil {
				break
			}
		}
	}
	acceptance := &computev1.Acceptance{Check: "diag.nvml", GpuModel: o.GPUModel, ExpectGpuCount: o.ExpectGPUs}
	if p := names[o.Name]; p != nil {
		a := p.GetAcceptance()
		if a.GetGpuModel() != o.GPUModel || a.GetExpectGpuCount() != o.ExpectGPUs {
			return "", fmt.Errorf("devstack: pool %s (%s) accepts GPU model %q × %d, not %q × %d", o.Name, p.GetId(),
				a.GetGpuModel(), a.GetExpectGpuCount(), o.GPUModel, o.ExpectGPUs)
		}
		return p.GetId(), nil
	}
	res, err := pools.CreatePool(ctx, connect.NewRequest(&computev1.CreatePoolRequest{
		SiteId: siteID, Name: o.Name, Kind: "metal-host", Acceptance: acceptance}))
	if err != nil {
		return "", fmt.Errorf("devstack: create pool %s: %w", o.Name, err)
	}
	return res.Msg.GetPool().GetId(), nil
}

// ensureSite returns the id of site dev-1, creating it when missing.
func (s *Stack) ensureSite(ctx context.Context, pools computev1connect.PoolServiceClient) (string, error) {
	sites, err := pools.ListSites(ctx, connect.NewRequest(&computev1.ListSitesRequest{}))
	if err != nil {
		return "", fmt.Errorf("devstack: list sites: %w", err)
	}
	for _, site := range sites.Msg.GetSites() {
		if site.GetName() == SiteName {
			return site.GetId(), nil
		}
	}
	res, err := pools.CreateSite(ctx, connect.NewRequest(&computev1.CreateSiteRequest{Name: SiteName, Region: SiteRegion}))
	if err != nil {
		return "", fmt.Errorf("devstack: create site %s: %w", SiteName, err)
	}
	return res.Msg.GetSite().GetId(), nil
}

// JoinToken mints a join token of pool admitting maxUses machines, valid
// for an hour, as the root administrator through the API, and returns its
// secret: for machines a caller runs itself (fakedaemon.Start, a fakedaemon
// process) instead of through Join.
func (s *Stack) JoinToken(ctx context.Context, pool string, maxUses int) (string, error) {
	res, err := computev1connect.NewJoinTokenServiceClient(http.DefaultClient, s.APIURL+"/api/compute", s.ClientOptions()...).
		CreateJoinToken(ctx, connect.NewRequest(&computev1.CreateJoinTokenRequest{
			PoolId: pool, MaxUses: int32(maxUses), TtlSeconds: int64(time.Hour / time.Second)}))
	if err != nil {
		return "", fmt.Errorf("devstack: join token for pool %s: %w", pool, err)
	}
	return res.Msg.GetSecret(), nil
}

// JoinOptions say which machines Join runs.
type JoinOptions struct {
	// Pool is the pool they join (required).
	Pool string
	// Count is how many machines, 1 to MaxJoin (default 1).
	Count int
	// Variant is their fake hardware (default hgx-h100; see fakehw).
	Variant string
	// Seed, when set, makes their hardware the same run after run (machine
	// ids, GPU UUIDs, hostnames derive from it).
	Seed string
	// Configure, when set, adjusts each Join's fakedaemon configuration
	// (command durations, the daemon core's timeouts) before it starts.
	Configure func(*fakedaemon.Config)
	// Timeout bounds the wait for every machine to have joined (default
	// 30 s plus 10 ms per machine); the machines keep trying after it.
	Timeout time.Duration
}

// Join runs o.Count simulated machines that join o.Pool as real daemons do:
// a join token of the pool allowing that many uses (minted through the API),
// sealed to JoinService's key and bound to each machine's CSR, the signed
// JoinResponse checked against the stack's pins, then an mTLS Session to a
// gateway. It returns their node ids, in machine order, once every machine
// has joined; a refused Join is an error. The machines run until Close.
//
// A stack with a DataDir keeps each Join's machines in
// DataDir/machines/<pool>[-<k>] (the k-th Join of the pool in this run), so
// the same Join in the next run restarts the same machines, which come back
// as the same nodes without joining again (a token is minted only for the
// machines that have not joined).
func (s *Stack) Join(ctx context.Context, o JoinOptions) ([]string, error) {
	if o.Pool == "" {
		return nil, errors.New("devstack: join: a pool is required")
	}
	if o.Count == 0 {
		o.Count = 1
	}
	if o.Count < 1 || o.Count > MaxJoin {
		return nil, fmt.Errorf("devstack: join: count must be from 1 to %d, got %d", MaxJoin, o.Count)
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultWaitTimeout + time.Duration(o.Count)*10*time.Millisecond
	}
	if o.Variant == "" {
		o.Variant = fakehw.VariantHGXH100
	}
	if _, err := fakehw.New(o.Variant, "check"); err != nil {
		return nil, fmt.Errorf("devstack: join: %w", err)
	}
	dir, err := s.fleet.reserveDir(filepath.Join(s.dataDir, DirMachines, o.Pool))
	if err != nil {
		return nil, err
	}
	missing := 0
	for i := range o.Count {
		ok, err := agent.Joined(filepath.Join(dir, strconv.Itoa(i)))
		if err != nil {
			return nil, fmt.Errorf("devstack: join: machine %d: %w", i, err)
		}
		if !ok {
			missing++
		}
	}
	cfg := fakedaemon.Config{
		Config: agent.Config{
			Server:  s.APIURL,
			Pins:    s.Pins,
			DataDir: dir,
			Nodes:   o.Count,
			// Machines that joined an earlier run of a kept stack hold
			// that run's gateway URLs: send them to this run's.
			GatewayURL:        s.GatewayURL(),
			GatewayServerName: "localhost",
		},
		Variant:       o.Variant,
		MachineIDSeed: o.Seed,
	}
	if missing > 0 {
		if cfg.Token, err = s.JoinToken(ctx, o.Pool, missing); err != nil {
			return nil, err
		}
	}
	if o.Configure != nil {
		o.Configure(&cfg)
	}
	rctx, cancel := context.WithCancel(context.Background())
	r, err := fakedaemon.New(cfg, agent.Deps{Logger: s.opts.MachineLogger, Clock: s.opts.Clock})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("devstack: join: %w", err)
	}
	go func() { _ = r.Run(rctx) }()
	if err := s.fleet.add(&joined{runner: r, cancel: cancel}); err != nil {
		cancel()
		_ = r.Wait()
		return nil, err
	}
	return s.waitJoined(ctx, r, o.Timeout)
}

// waitJoined waits up to timeout until every machine of r has a node id,
// and returns them.
func (s *Stack) waitJoined(ctx context.Context, r *agent.Runner, timeout time.Duration) ([]string, error) {
	clk := s.opts.Clock
	deadline := clk.Now().Add(timeout)
	for {
		ids := make([]string, 0, len(r.Machines()))
		for _, m := range r.Machines() {
			if id := m.NodeID(); id != "" {
				ids = append(ids, id)
			}
		}
		if len(ids) == len(r.Machines()) {
			return ids, nil
		}
		select {
		case <-r.Done():
			if err := r.Wait(); err != nil {
				return nil, fmt.Errorf("devstack: join: %w", err)
			}
			return nil, errors.New("devstack: join: the machines stopped before they joined")
		default:
		}
		if !clk.Now().Before(deadline) {
			return nil, fmt.Errorf("devstack: join: %d of %d machines joined after %s", len(ids), len(r.Machines()), timeout)
		}
		if err := clock.Sleep(ctx, clk, 20*time.Millisecond); err != nil {
			return nil, fmt.Errorf("devstack: join: %d of %d machines joined: %w", len(ids), len(r.Machines()), err)
		}
	}
}

// Daemons returns every simulated machine of every Join, in the order they
// were joined.
func (s *Stack) Daemons() []*agent.Machine {
	s.fleet.mu.Lock()
	defer s.fleet.mu.Unlock()
	var out []*agent.Machine
	for _, j := range s.fleet.runners {
		out = append(out, j.runner.Machines()...)
	}
	return out
}

// WaitOptions say what WaitFor waits for.
type WaitOptions struct {
	// State is the provision state to wait for (default store.NodeAdopted,
	// which also waits until the node has applied NodeSpec generation 1 or
	// later).
	State string
	// Timeout bounds the wait (default DefaultWaitTimeout).
	Timeout time.Duration
	// Connected also waits until the machine of each node (one of this
	// stack's Joins) holds a live session, and fails as soon as one has
	// stopped for good (revoked, its certificate expired). Without it a
	// node adopted in an earlier run of a kept stack is adopted at once.
	Connected bool
}

// NodeStatus is a node's provision state as WaitFor saw it last.
type NodeStatus struct {
	ID                 string
	ProvisionState     string
	ProvisionReason    string
	ObservedGeneration int64
}

// WaitFor waits until every node of nodeIDs is in o.State and returns their
// statuses, in nodeIDs' order. It fails as soon as a node can no longer get
// there (it failed acceptance while waiting for adopted), when a node does
// not exist, and after o.Timeout, naming the nodes not there yet with their
// states.
func (s *Stack) WaitFor(ctx context.Context, nodeIDs []string, o WaitOptions) ([]NodeStatus, error) {
	if o.State == "" {
		o.State = store.NodeAdopted
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultWaitTimeout
	}
	clk := s.opts.Clock
	deadline := clk.Now().Add(o.Timeout)
	var machines map[string]*agent.Machine
	if o.Connected {
		machines = map[string]*agent.Machine{}
		for _, m := range s.Daemons() {
			machines[m.NodeID()] = m
		}
		for _, id := range nodeIDs {
			if machines[id] == nil {
				return nil, fmt.Errorf("devstack: wait: node %s is not a machine of this stack's", id)
			}
		}
	}
	for {
		st, err := s.nodeStatuses(ctx, nodeIDs)
		if err != nil {
			return nil, err
		}
		var waiting []string
		for _, n := range st {
			var ms agent.MachineStatus
			if m := machines[n.ID]; m != nil {
				ms = m.Status()
			}
			switch {
			case n.ProvisionState == "":
				return nil, fmt.Errorf("devstack: wait: node %s does not exist", n.ID)
			case ms.Stopped != "":
				return st, fmt.Errorf("devstack: wait: node %s's machine stopped for good: %s", n.ID, ms.Stopped)
			case o.State == store.NodeAdopted && n.ProvisionState == store.NodeAcceptanceFailed:
				return st, fmt.Errorf("devstack: wait: node %s failed acceptance: %s", n.ID, n.ProvisionReason)
			case n.ProvisionState != o.State || (o.State == store.NodeAdopted && n.ObservedGeneration < 1):
				waiting = append(waiting, fmt.Sprintf("%s %s (generation %d applied)", n.ID, n.ProvisionState, n.ObservedGeneration))
			case o.Connected && ms.SessionID == "":
				waiting = append(waiting, fmt.Sprintf("%s %s, its machine not connected", n.ID, n.ProvisionState))
			}
		}
		if len(waiting) == 0 {
			return st, nil
		}
		notYet := func(after string) error {
			n := len(waiting)
			if n > 5 {
				waiting = append(waiting[:5], "…")
			}
			return fmt.Errorf("devstack: wait: %d of %d nodes not %s %s: %s", n, len(nodeIDs), o.State, after, strings.Join(waiting, ", "))
		}
		if !clk.Now().Before(deadline) {
			return st, notYet("after " + o.Timeout.String())
		}
		if err := clock.Sleep(ctx, clk, 50*time.Millisecond); err != nil {
			return st, fmt.Errorf("%w (%w)", notYet("when the wait ended"), err)
		}
	}
}

// nodeStatuses reads the provision states of ids (ProvisionState "" for a
// node that does not exist).
func (s *Stack) nodeStatuses(ctx context.Context, ids []string) ([]NodeStatus, error) {
	rows, err := s.DB.Pool.Query(ctx, `SELECT id, provision_state, provision_reason, observed_generation
		FROM nodes WHERE id = ANY($1)`, ids)
	if err != nil {
		return nil, fmt.Errorf("devstack: wait: %w", err)
	}
	defer rows.Close()
	byID := map[string]NodeStatus{}
	for rows.Next() {
		var n NodeStatus
		if err := rows.Scan(&n.ID, &n.ProvisionState, &n.ProvisionReason, &n.ObservedGeneration); err != nil {
			return nil, err
		}
		byID[n.ID] = n
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	out := make([]NodeStatus, len(ids))
	for i, id := range ids {
		out[i] = byID[id]
		out[i].ID = id
	}
	return out, nil
}
