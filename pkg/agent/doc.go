// Package agent is the node agent of better-compute: the machine side of the
// protocol around the daemon core (pkg/daemon), for one machine or many in a
// process. Each machine joins through JoinService with a fresh key and CSR,
// keeps its identity and command journal on disk, and drives its daemon core
// over a Session to the gateway (HTTP/2, mutual TLS with its node
// certificate), on its Hardware. The fakedaemon (services/fakedaemon) is this
// package on fake hardware (pkg/fakehw); a daemon for real machines is this
// package on an implementation of Hardware that reads the host.
//
// Joining (jointrust.go, machine.go): the join keys come from the
// deployment's well-known document or from Config, each checked against the
// pins before any Join; the token is sealed to JoinService's HPKE key and
// bound to the CSR (never sent in clear), and the JoinResponse is used only
// after pki.CheckJoinResponse accepted it: signed by the pinned join signing
// key, its serving CA matching the servingCa pin, its command-signing root
// matching the commandSigning pin.
//
// The Runner (runner.go) owns every goroutine and all I/O; the protocol logic
// lives in daemon.Agent, the same code the fleet simulator drives on a
// virtual clock. Each machine's driver (driver.go) feeds its core what the
// stream and timer bring and carries out the core's effects; renew.go stores
// renewed certificates; transport.go is the HTTP/2 transport and the
// connections it tracks so that a silent gateway's are closed. Each machine
// costs two goroutines of its own (its loop and the reader of its current
// stream) plus what net/http's HTTP/2 client keeps per connection.
//
// Tunnels (docs/architecture.md, "Tunnels"; tunnel.go, sshd.go): on the
// core's EffectOpenTunnel the driver dials GatewayService.Tunnel to the
// session's gateway with the node certificate and serves the tunnel on
// goroutines of its own (at most MaxTunnels at a time): a shell tunnel runs
// Hardware.Shell on a terminal fed by the frames, an ssh tunnel carries one
// connection to the machine's SSH server, which listens on no port and
// accepts only certificates that sshca.Authorize accepts against the
// core's SSHAccess (the applied spec's CAs and reservations). The SSH
// server hands each refused login to the loop, which has the core report
// it on the session (Report.ssh_refused). Tunnels end when the machine
// stops (for good, or its Runner) or reboots, and when their gateway's
// connections are dropped as silent.
//
// A machine's directory (DataDir/<index>) holds: join.pending while its
// first Join is not done (0600; the key and machine id it joins with, so a
// machine stopped mid-join joins again as the same node), node.json (0600;
// the whole identity: node and machine ids, key and certificates; written
// once, atomically, when the Join completes, just after an empty
// journal.jsonl, and then join.pending goes), boot (the boot counter: every
// process start is a boot; the start that joined is boot 0), and
// journal.epoch once a journal loss was found (see FileJournal), and
// ssh_host_ed25519_key (HostKeyFile, 0600; the SSH server's host key, made
// at the first ssh tunnel and kept across restarts). A running
// machine holds an exclusive flock on its directory, so two processes never
// share an identity. A restart reuses the identity and never joins again,
// and rewrites one file (the boot counter); deleting journal.jsonl simulates
// a journal loss.
//
// To run machines in-process (tests, `better-compute dev --sim N`), call
// Start and read the handles from Runner.Machines. To run on other hardware,
// implement Hardware and pass a HardwareFunc in Deps; to add a command kind,
// teach the Hardware's Run about it (and the daemon core, for a kind with an
// effect on the session).
package agent
