package compose_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"github.com/stretchr/testify/require"

	"github.com/better-compute/better-compute/pkg/clock"
)

// replicaScale is the --scale flags of TestComposeReplicas: two replicas of
// every control-plane service (the gateways are two services already) and
// 8 machines. Every `up` of that stack repeats them, or compose would scale
// the services back to one.
var replicaScale = []string{"--scale", "api=2", "--scale", "joinservice=2", "--scale", "scheduler=2",
	"--scale", "controllers=2", "--scale", "fakedaemon=8"}

// TestComposeReplicas is issue 18's replica drill: the stack with two
// replicas of api, joinservice, scheduler and controllers, NATS as a
// three-node cluster (nats-cluster.yaml) and 8 machines renewing
// certificates of 2 minutes; reservations and commands flow from workers
// the whole time while one replica of each service in turn, then one NATS
// node, is killed (SIGKILL) and started again.
// Then nothing is lost (every reservation is active or released as asked,
// one per request id; every command reached a terminal state, succeeded,
// with exactly one terminal event, one per request id) and nothing ran
// twice (each machine's journal holds one run of each command). For each
// kill it logs the seconds until its work resumed: the leases the replica
// held taken over, the first reservation made after the kill active, the
// first command queued after it finished, and for joinservice a machine
// joining after it adopted and a certificate renewed after it.
func TestComposeReplicas(t *testing.T) {
	s := newProject(t, "bcrep", []string{"tests/compose/nats-cluster.yaml"})
	// Node certificates of 2 minutes: machines renew them (through their
	// gateway, signed by JoinService on its control listener) 80 s after
	// each, so renewals flow during the kills too.
	s.env = append(s.env, "BETTER_COMPUTE_NODE_CERT_TTL=2m")
	s.mustRun(append([]string{"up", "-d"}, replicaScale...)...)
	s.credentials()
	var nodes []string
	for _, n := range s.waitAdopted(8, 3*time.Minute) {
		nodes = append(nodes, n.ID)
	}
	for svc, n := range map[string]int{"api": 2, "joinservice": 2, "scheduler": 2, "controllers": 2, "fakedaemon": 8,
		"nats": 1, "nats-b": 1, "nats-c": 1} {
		require.Len(t, s.containers(svc), n, "replicas of %s", svc)
	}
	pool, tenant := s.envValue("BETTER_COMPUTE_POOL"), s.envValue("BETTER_COMPUTE_TENANT")
	s.cliRun("pools", "offer", pool, "--to", tenant, "--quota", "gpu=64")

	// A watch of the commands' events through api-lb for the whole drill:
	// when its API replica is killed it resumes on the other.
	watch := s.startWatch("command.*")
	require.NoError(t, clock.Sleep(t.Context(), clock.New(), time.Second)) // subscribed before the first command
	w := &workload{s: s, pool: pool, nodes: nodes, stop: make(chan struct{})}
	var wg sync.WaitGroup
	for i := range 2 {
		wg.Go(func() { w.run(i) })
	}
	// Work flows before the first kill.
	require.Eventually(t, func() bool { return w.done() >= 2 }, 2*time.Minute, 500*time.Millisecond, "the workers make progress")

	wall := clock.New()
	for _, svc := range []string{"api", "joinservice", "scheduler", "controllers", "nats"} {
		victim := s.pickVictim(svc)
		leases := s.leasesOf(victim)
		done := w.done()
		killedAt := s.dbNow()
		began := wall.Now()
		out, err := exec.CommandContext(t.Context(), "docker", "kill", victim).CombinedOutput()
		require.NoError(t, err, "docker kill %s: %s", victim, out)
		figures := s.resumed(svc, victim, leases, killedAt, 2*time.Minute)
		t.Logf("kill of %s replica %s (leases %v): %s", svc, victim[:12], leases, figures)
		// The workers went on through the kill.
		require.Eventually(t, func() bool { return w.done() > done }, 2*time.Minute, 500*time.Millisecond,
			"the workers make progress after the kill of %s", svc)
		out, err = exec.CommandContext(t.Context(), "docker", "start", victim).CombinedOutput()
		require.NoError(t, err, "docker start %s: %s", victim, out)
		s.waitHealthy(victim, 2*time.Minute)
		t.Logf("%s replica %s healthy again %s after its kill", svc, victim[:12], clock.Since(wall, began).Round(100*time.Millisecond))
	}
	close(w.stop)
	wg.Wait()
	require.Empty(t, w.errs(), "worker failures")
	s.checkNothingLost(w)
	s.checkNothingRanTwice(w)
	s.checkWatch(w, watch)
}

// watchedEvent is a line of `events watch`.
type watchedEvent struct {
	ID        int64  `json:"id"`
	Type      string `json:"type"`
	SubjectID string `json:"subjectId"`
}

// eventWatch is `better-compute events watch` running in the background.
type eventWatch struct {
	cancel func()
	cmd    *exec.Cmd
	stderr bytes.Buffer // read only after Wait
	read   chan struct{}

	mu     sync.Mutex
	events []watchedEvent
}

// startWatch starts `events watch --types types`, from now; the test's
// cleanup stops it.
func (s *stack) startWatch(types string) *eventWatch {
	t := s.t
	ctx, cancel := context.WithCancel(t.Context())
	w := &eventWatch{cancel: cancel, read: make(chan struct{})}
	w.cmd = exec.CommandContext(ctx, s.cli, "events", "watch", "--types", types)
	w.cmd.Env = s.env
	w.cmd.Stderr = &w.stderr
	out, err := w.cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, w.cmd.Start())
	go func() {
		defer close(w.read)
		dec := json.NewDecoder(out)
		for {
			var e watchedEvent
			if dec.Decode(&e) != nil {
				return
			}
			w.mu.Lock()
			w.events = append(w.events, e)
			w.mu.Unlock()
		}
	}()
	t.Cleanup(func() { w.stop() })
	return w
}

func (w *eventWatch) snapshot() []watchedEvent {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.events)
}

// stop ends the watch and returns its standard error.
func (w *eventWatch) stop() string {
	w.cancel()
	<-w.read
	_ = w.cmd.Wait()
	return w.stderr.String()
}

// checkWatch: the watch that ran through every kill printed each
// command's command.queued and its terminal event exactly once, in
// increasing id order (no gap, no duplicate across its reconnections).
func (s *stack) checkWatch(w *workload, watch *eventWatch) {
	t := s.t
	terminal := func(typ string) bool {
		return typ == "command.succeeded" || typ == "command.failed" || typ == "command.expired"
	}
	ours := map[string]bool{}
	for _, a := range w.asked {
		ours[a.command] = true
	}
	require.Eventually(t, func() bool {
		ended := map[string]bool{}
		for _, e := range watch.snapshot() {
			if terminal(e.Type) && ours[e.SubjectID] {
				ended[e.SubjectID] = true
			}
		}
		return len(ended) == len(ours)
	}, time.Minute, 500*time.Millisecond, "the watch printed every command's end")
	stderr := watch.stop()
	events := watch.snapshot()
	for i := 1; i < len(events); i++ {
		require.Greater(t, events[i].ID, events[i-1].ID, "event ids increase: no duplicate")
	}
	want, got := map[string]int{}, map[string]int{}
	for id := range ours {
		want[id+" command.queued"], want[id+" end"] = 1, 1
	}
	for _, e := range events {
		if !ours[e.SubjectID] {
			continue
		}
		switch {
		case e.Type == "command.queued":
			got[e.SubjectID+" command.queued"]++
		case terminal(e.Type):
			got[e.SubjectID+" end"]++
		}
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("events the watch printed per command (-want +got):\n%s", diff)
	}
	t.Logf("the watch printed %d events, reconnecting %d times:\n%s", len(events), strings.Count(stderr, "resuming"), stderr)
}

// asked is one worker iteration: a reservation, the command run on its
// node, and whether it was released.
type asked struct {
	reqID, reservation string
	// node is where the command ran (the nodes in turn, not the
	// reservation's: every machine's journal gets a few).
	node              string
	cmdReqID, command string
	released          bool
}

// workload is the workers' shared record of what they asked for.
type workload struct {
	s    *stack
	pool string
	// nodes are the 8 machines' nodes, which the commands go to in turn.
	nodes []string
	stop  chan struct{}

	mu       sync.Mutex
	asked    []asked
	failures []string
}

func (w *workload) done() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.asked)
}

func (w *workload) errs() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.failures
}

// maxIterations bounds each worker: with two workers, at most 100
// commands, spread evenly over the 8 machines (three journal lines each),
// so that no machine's journal is compacted (pkg/agent compacts beyond 64
// superfluous lines) before it is read, and at most 50 reservations of one
// GPU stay active, within the quota of 64.
const maxIterations = 50

// pace is the least time between two iterations of a worker: the kills
// take a few minutes, and the workers must not run out of iterations
// before.
const pace = 4 * time.Second

// run is worker i: reserve one GPU (waiting until active), run diag.nvml
// on the next of the nodes in turn, release every other reservation, until
// stopped. Each call
// is retried with its idempotency key until it succeeds (a killed API
// replica drops the calls it was serving), within a generous deadline.
func (w *workload) run(i int) {
	wall := clock.New()
	for n := 0; n < maxIterations; n++ {
		select {
		case <-w.stop:
			return
		default:
		}
		began := wall.Now()
		a := asked{reqID: fmt.Sprintf("rep-w%d-%d", i, n), node: w.nodes[(i+2*n)%len(w.nodes)]}
		a.cmdReqID = "cmd-" + a.reqID
		var r struct {
			ID     string `json:"id"`
			State  string `json:"state"`
			NodeID string `json:"nodeId"`
		}
		if !w.retry(wall, "reserve "+a.reqID, func() error {
			out, err := w.s.cli2("reserve", "--pool", w.pool, "--gpus", "1", "--for", "1h", "--request-id", a.reqID,
				"--wait", "--timeout", "30s")
			if err != nil {
				return err
			}
			if err := json.Unmarshal([]byte(out), &r); err != nil {
				return fmt.Errorf("reserve output %q: %w", out, err)
			}
			if r.State != "active" {
				return fmt.Errorf("reservation %s is %s", r.ID, r.State)
			}
			return nil
		}) {
			return
		}
		a.reservation = r.ID
		if !w.retry(wall, "command "+a.cmdReqID, func() error {
			out, err := w.s.cli2("commands", "run", "--node", a.node, "diag.nvml", "--request-id", a.cmdReqID, "--timeout", "5m")
			if err != nil {
				return err
			}
			var c struct {
				ID string `json:"id"`
			}
			if err := json.Unmarshal([]byte(out), &c); err != nil {
				return fmt.Errorf("commands run output %q: %w", out, err)
			}
			if c.ID == "" {
				return fmt.Errorf("commands run output %q: no id", out)
			}
			a.command = c.ID
			return nil
		}) {
			return
		}
		if n%2 == 0 {
			if !w.retry(wall, "release "+a.reservation, func() error {
				out, err := w.s.cli2("release", a.reservation)
				if err == nil || w.s.reservationState(a.reservation) == "released" {
					return nil
				}
				return fmt.Errorf("release: %s: %w", out, err)
			}) {
				return
			}
			a.released = true
		}
		w.mu.Lock()
		w.asked = append(w.asked, a)
		w.mu.Unlock()
		if clock.Sleep(w.s.t.Context(), wall, pace-clock.Since(wall, began)) != nil {
			return
		}
	}
}

// retry calls f until it succeeds, every 500 ms for at most 3 minutes; it
// records the last error and returns false when f never succeeded.
func (w *workload) retry(wall clock.Clock, what string, f func() error) bool {
	began := wall.Now()
	for {
		err := f()
		if err == nil {
			return true
		}
		if clock.Since(wall, began) > 3*time.Minute {
			w.mu.Lock()
			w.failures = append(w.failures, fmt.Sprintf("%s: %v", what, err))
			w.mu.Unlock()
			return false
		}
		if clock.Sleep(w.s.t.Context(), wall, 500*time.Millisecond) != nil {
			return false
		}
	}
}

// cli2 runs the CLI with the stack's credentials and returns its standard
// output, or an error with its standard error; for goroutines, which must
// not fail the test themselves.
func (s *stack) cli2(args ...string) (string, error) {
	cmd := exec.CommandContext(s.t.Context(), s.cli, args...)
	cmd.Env = s.env
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return string(out), fmt.Errorf("better-compute %v: %w: %s", args, err, strings.TrimSpace(stderr.String()))
	}
	return string(out), nil
}

// containers returns the ids of the running containers of service svc.
func (s *stack) containers(svc string) []string {
	s.t.Helper()
	out, err := exec.CommandContext(s.t.Context(), "docker", "ps", "-q", "--no-trunc",
		"--filter", "label=com.docker.compose.project="+s.project,
		"--filter", "label=com.docker.compose.service="+svc).CombinedOutput()
	require.NoError(s.t, err, string(out))
	ids := strings.Fields(string(out))
	sort.Strings(ids)
	return ids
}

// pgContainer returns the postgres container's id.
func (s *stack) pgContainer() string {
	ids := s.containers("postgres")
	require.Len(s.t, ids, 1)
	return ids[0]
}

// query runs sql as bc and returns its unaligned output; "" on an error
// (for polls; the caller's assertion says what was wanted).
func (s *stack) query(sql string) string {
	out, err := s.psqlErr(s.pgContainer(), "bc", "bc", sql)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(out)
}

// dbNow is the database's clock, which stamps the rows and events the
// figures are read from.
func (s *stack) dbNow() string {
	now := s.query(`SELECT to_char(clock_timestamp() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"')`)
	require.NotEmpty(s.t, now)
	return now
}

// pickVictim returns the replica of svc to kill: for the scheduler and the
// controllers the one holding the most leases (killing an idle standby
// would test nothing), else the first.
func (s *stack) pickVictim(svc string) string {
	ids := s.containers(svc)
	if svc == "nats" {
		// One node of the three-node cluster (nats, nats-b, nats-c).
		require.Len(s.t, ids, 1)
		return ids[0]
	}
	require.Len(s.t, ids, 2, "replicas of %s before its kill", svc)
	best, most := ids[0], -1
	for _, id := range ids {
		if n := len(s.leasesOf(id)); n > most {
			best, most = id, n
		}
	}
	if svc == "scheduler" || svc == "controllers" {
		require.Positive(s.t, most, "a %s replica holds a lease", svc)
	}
	return best
}

// leasesOf returns the names of the unexpired leases container id holds
// (a holder is "<hostname>-<hex>", the hostname the container id's first
// 12 digits).
func (s *stack) leasesOf(id string) []string {
	out := s.query(fmt.Sprintf(`SELECT name FROM leases WHERE holder LIKE '%s-%%' AND expires_at > now() ORDER BY name`, id[:12]))
	return strings.Fields(out)
}

// resumed waits until the work of the killed replica victim of svc has
// resumed and returns the figures, seconds after killedAt (the database's
// clock): each lease it held held by another replica, the first
// reservation created after the kill active, the first command queued
// after it finished; for joinservice, a machine started after the kill
// adopted.
func (s *stack) resumed(svc, victim string, leases []string, killedAt string, within time.Duration) string {
	t := s.t
	wall := clock.New()
	began := wall.Now()
	var figures []string
	if len(leases) > 0 {
		require.Eventually(t, func() bool {
			out := s.query(fmt.Sprintf(`SELECT count(*) FROM leases WHERE name IN ('%s') AND holder NOT LIKE '%s-%%' AND expires_at > now()`,
				strings.Join(leases, "','"), victim[:12]))
			return out == strconv.Itoa(len(leases))
		}, within, 200*time.Millisecond, "the leases %v of %s taken over", leases, victim[:12])
		figures = append(figures, fmt.Sprintf("leases taken over after %.1fs", clock.Since(wall, began).Seconds()))
	}
	if svc == "joinservice" {
		out := s.mustRun("run", "-d", "--no-deps", "fakedaemon")
		t.Logf("a machine joining after the kill: %s", strings.TrimSpace(out))
		s.waitAdopted(9, within)
		figures = append(figures, fmt.Sprintf("a machine started after the kill adopted after %.1fs", clock.Since(wall, began).Seconds()))
		// The gateways have renewals signed on joinservice-control, which
		// resolves to both replicas: a renewal after the kill.
		var secs string
		require.Eventually(t, func() bool {
			secs = s.query(fmt.Sprintf(`SELECT EXTRACT(EPOCH FROM min(c.created_at) - '%[1]s'::timestamptz) FROM node_certs c
				JOIN nodes n ON n.id = c.node_id WHERE c.created_at > '%[1]s'::timestamptz AND n.created_at < '%[1]s'::timestamptz`, killedAt))
			return secs != ""
		}, within, 500*time.Millisecond, "a node certificate renewed after the kill of joinservice")
		f, err := strconv.ParseFloat(secs, 64)
		require.NoError(t, err, secs)
		figures = append(figures, fmt.Sprintf("a node certificate renewed after %.1fs", f))
	}
	for _, c := range []struct{ what, sql string }{
		{"first reservation made after the kill active", `SELECT EXTRACT(EPOCH FROM min(a.created_at) - '%[1]s'::timestamptz) FROM events a
			JOIN events c ON c.subject_id = a.subject_id AND c.type = 'reservation.created'
			WHERE a.type = 'reservation.active' AND c.created_at > '%[1]s'::timestamptz`},
		{"first command queued after the kill finished", `SELECT EXTRACT(EPOCH FROM min(a.created_at) - '%[1]s'::timestamptz) FROM events a
			JOIN events c ON c.subject_id = a.subject_id AND c.type = 'command.queued'
			WHERE a.type IN ('command.succeeded', 'command.failed', 'command.expired') AND c.created_at > '%[1]s'::timestamptz`},
	} {
		var secs string
		require.Eventually(t, func() bool {
			secs = s.query(fmt.Sprintf(c.sql, killedAt))
			return secs != ""
		}, within, 500*time.Millisecond, "%s after the kill of %s", c.what, svc)
		f, err := strconv.ParseFloat(secs, 64)
		require.NoError(t, err, secs)
		figures = append(figures, fmt.Sprintf("%s after %.1fs", c.what, f))
	}
	if svc == "nats" {
		// Pokes published while a client moved to another node are lost;
		// the gateways' resync (GATEWAY_RESYNC) finds the work anyway.
		figures = append(figures, "the gateways resync every 5s")
	}
	return strings.Join(figures, "; ")
}

// waitHealthy waits until container id reports healthy.
func (s *stack) waitHealthy(id string, within time.Duration) {
	require.Eventually(s.t, func() bool {
		out, err := exec.CommandContext(s.t.Context(), "docker", "inspect", "--format", "{{.State.Health.Status}}", id).Output()
		return err == nil && strings.TrimSpace(string(out)) == "healthy"
	}, within, time.Second, "container %s healthy", id[:12])
}

// reservationState reads a reservation's state from the database.
func (s *stack) reservationState(id string) string {
	return s.query(fmt.Sprintf(`SELECT state FROM reservations WHERE id = '%s'`, id))
}

// checkNothingLost: every command reached a terminal state, succeeded, with
// exactly one terminal event; one command per request id and one
// reservation per request id; every reservation is active or released as
// asked.
func (s *stack) checkNothingLost(w *workload) {
	t := s.t
	require.NotEmpty(t, w.asked)
	var cmds []string
	for _, a := range w.asked {
		cmds = append(cmds, a.command)
	}
	in := "('" + strings.Join(cmds, "','") + "')"
	require.Eventually(t, func() bool {
		return s.query(`SELECT count(*) FROM commands WHERE state IN ('queued', 'delivered', 'running') AND id IN `+in) == "0"
	}, 3*time.Minute, time.Second, "every command finished")
	states := map[string]string{}
	for _, line := range strings.Split(s.query(`SELECT id || ' ' || state FROM commands WHERE id IN `+in), "\n") {
		if id, state, ok := strings.Cut(line, " "); ok {
			states[id] = state
		}
	}
	ends := map[string]int{}
	for _, id := range strings.Fields(s.query(`SELECT subject_id FROM events
		WHERE type IN ('command.succeeded', 'command.failed', 'command.expired') AND subject_id IN ` + in)) {
		ends[id]++
	}
	wantStates, wantEnds := map[string]string{}, map[string]int{}
	for _, id := range cmds {
		wantStates[id], wantEnds[id] = "succeeded", 1
	}
	if diff := cmp.Diff(wantStates, states); diff != "" {
		t.Errorf("command states (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(wantEnds, ends); diff != "" {
		t.Errorf("terminal events per command (-want +got):\n%s", diff)
	}
	require.Equal(t, "0", s.query(`SELECT count(*) FROM (SELECT request_id FROM commands WHERE request_id LIKE 'cmd-rep-%'
		GROUP BY request_id HAVING count(*) > 1) d`), "one command per request id")

	want, got := map[string]string{}, map[string]string{}
	for _, a := range w.asked {
		want[a.reqID] = "active"
		if a.released {
			want[a.reqID] = "released"
		}
	}
	for _, line := range strings.Split(s.query(`SELECT request_id || ' ' || state FROM reservations WHERE request_id LIKE 'rep-%'`), "\n") {
		if req, state, ok := strings.Cut(line, " "); ok && want[req] != "" {
			got[req] = state
		}
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("reservations by request id (-want +got):\n%s", diff)
	}
	t.Logf("%d reservations (%d released) and %d commands, none lost", len(w.asked), countReleased(w.asked), len(cmds))
}

func countReleased(as []asked) int {
	n := 0
	for _, a := range as {
		if a.released {
			n++
		}
	}
	return n
}

// checkNothingRanTwice reads every machine's journal (pkg/agent's
// journal.jsonl, one JSON record per line; a command is journaled as
// RUNNING once each time it starts) and asserts each command of the
// workload started once, on its node's machine only.
func (s *stack) checkNothingRanTwice(w *workload) {
	t := s.t
	runs := map[string]int{}
	for _, id := range s.containersAll("fakedaemon") {
		out, err := exec.CommandContext(t.Context(), "sh", "-c",
			"docker cp "+id+":/var/lib/fakedaemon/0/journal.jsonl - | tar -xO").Output()
		if err != nil {
			continue // a machine that never ran a command has no journal
		}
		sc := bufio.NewScanner(bytes.NewReader(out))
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var rec struct {
				ID          string `json:"id"`
				State       string `json:"state"`
				Interrupted string `json:"interrupted"`
			}
			// An interrupted mark (a reboot cut the run short) is no start.
			if json.Unmarshal(sc.Bytes(), &rec) == nil && rec.ID != "" && strings.HasSuffix(rec.State, "RUNNING") && rec.Interrupted == "" {
				runs[rec.ID]++
			}
		}
	}
	want, got := map[string]int{}, map[string]int{}
	for _, a := range w.asked {
		want[a.command] = 1
		got[a.command] = runs[a.command]
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("runs per command in the machines' journals (-want +got):\n%s", diff)
	}
}

// containersAll returns the ids of every container of service svc,
// stopped ones and one-off runs included.
func (s *stack) containersAll(svc string) []string {
	s.t.Helper()
	out, err := exec.CommandContext(s.t.Context(), "docker", "ps", "-aq", "--no-trunc",
		"--filter", "label=com.docker.compose.project="+s.project,
		"--filter", "label=com.docker.compose.service="+svc).CombinedOutput()
	require.NoError(s.t, err, string(out))
	return strings.Fields(string(out))
}
