package store

import (
	"context"
	"fmt"
	"time"
)

// FleetStats are the figures the controllers export as gauges
// (docs/metrics.md): one read of the database, FleetStatsAt.
type FleetStats struct {
	// Nodes are the unrevoked nodes by provision state and reachability.
	Nodes []NodeCount
	// GPUs are the GPUs of the adopted, unrevoked nodes of each pool that
	// has any, booked (a booking holds the device at the time read) or free.
	GPUs []PoolGPUCount
	// Reservations are the reservations not yet ended, by state (pending,
	// binding, active; a state without any is absent).
	Reservations map[string]int64
	// Commands are the commands not yet finished, by kind and state.
	Commands []CommandCount
	// OutboxRows is how many outbox rows wait to be published; OutboxAge
	// how long the oldest has waited (0 when none).
	OutboxRows int64
	OutboxAge  time.Duration
}

// NodeCount is a number of nodes of one provision state and reachability.
type NodeCount struct {
	ProvisionState string
	Reachable      bool
	N              int64
}

// PoolGPUCount is a number of GPUs of one pool in one state (booked, free).
type PoolGPUCount struct {
	PoolID, PoolName, State string
	N                       int64
}

// CommandCount is a number of open commands of one kind and state.
type CommandCount struct {
	Kind, State string
	N           int64
}

// GPU states of PoolGPUCount.
const (
	GPUBooked = "booked"
	GPUFree   = "free"
)

// FleetStatsAt reads FleetStats at now in one statement. Each part reads
// through an index or a small table: open commands (commands_open_idx),
// live reservations (their partial indexes), the bookings of each device
// (the exclusion constraint's index), the outbox's backlog; the nodes,
// devices and pools are scanned, one row per machine or GPU.
func FleetStatsAt(ctx context.Context, q DBTX, now time.Time) (FleetStats, error) {
	rows, err := q.Query(ctx, `
		SELECT 'nodes', provision_state, reachable::text, '', count(*), 0::float8
			FROM nodes WHERE revoked_at IS NULL GROUP BY provision_state, reachable
		UNION ALL
		SELECT 'gpus', p.id, p.name, CASE WHEN EXISTS (SELECT 1 FROM bookings b WHERE b.node_id = d.node_id
				AND b.device_index = d.device_index AND b.during @> $1::timestamptz) THEN '`+GPUBooked+`' ELSE '`+GPUFree+`' END,
				count(*), 0::float8
			FROM node_devices d JOIN nodes n ON n.id = d.node_id JOIN pools p ON p.id = n.pool_id
			WHERE n.provision_state = 'adopted' AND n.revoked_at IS NULL GROUP BY 2, 3, 4
		UNION ALL
		SELECT 'reservations', state, '', '', count(*), 0::float8
			FROM reservations WHERE state IN ('pending', 'binding', 'active') GROUP BY state
		UNION ALL
		SELECT 'commands', kind, state, '', count(*), 0::float8
			FROM commands WHERE finished_at IS NULL GROUP BY kind, state
		UNION ALL
		SELECT 'outbox', '', '', '', count(*), COALESCE(extract(epoch FROM $1::timestamptz - min(created_at)), 0)::float8
			FROM outbox`, now)
	if err != nil {
		return FleetStats{}, fmt.Errorf("fleet stats: %w", interpretError(err))
	}
	defer rows.Close()
	s := FleetStats{Reservations: map[string]int64{}}
	for rows.Next() {
		var what, a, b, c string
		var n int64
		var age float64
		if err := rows.Scan(&what, &a, &b, &c, &n, &age); err != nil {
			return FleetStats{}, fmt.Errorf("fleet stats: %w", err)
		}
		switch what {
		case "nodes":
			s.Nodes = append(s.Nodes, NodeCount{ProvisionState: a, Reachable: b == "true", N: n})
		case "gpus":
			s.GPUs = append(s.GPUs, PoolGPUCount{PoolID: a, PoolName: b, State: c, N: n})
		case "reservations":
			s.Reservations[a] = n
		case "commands":
			s.Commands = append(s.Commands, CommandCount{Kind: a, State: b, N: n})
		case "outbox":
			s.OutboxRows, s.OutboxAge = n, time.Duration(max(age, 0)*float64(time.Second))
		}
	}
	if err := rows.Err(); err != nil {
		return FleetStats{}, fmt.Errorf("fleet stats: %w", interpretError(err))
	}
	return s, nil
}
