package store

// A node's NodeSpec carries exactly the allocations of its placed
// reservations (docs/architecture.md, "Reservations"): every writer that
// places or ends a reservation rebuilds the specs of its nodes in the same
// transaction (RebuildNodeSpecs).

import (
	"context"
	"fmt"
	"slices"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	gatewayv1 "github.com/better-compute/better-compute/api/gen/bc/gateway/v1"
)

// RebuildNodeSpecs makes each node's NodeSpec allocations exactly its placed
// reservations (state binding or active) with their booked device indexes,
// and its SSH user CAs the deployment's (SSHUserCAs), keeping the spec's
// labels. A node whose allocations or CAs change gets the next
// spec generation, signed (signer; nil: unsigned), and its gateway is poked;
// reservations newly in a spec record that generation. Nodes are locked in
// id order. It returns the new generation of each node that changed. Call it
// in the transaction that placed or ended the reservations. It costs a fixed
// number of round trips whatever the number of nodes. Errors: ErrNotFound
// when a node does not exist.
func RebuildNodeSpecs(ctx context.Context, q DBTX, signer *IntentSigner, now time.Time, nodeIDs []string) (map[string]int64, error) {
	ids := slices.Clone(nodeIDs)
	slices.Sort(ids)
	ids = slices.Compact(ids)
	changed := map[string]int64{}
	if len(ids) == 0 {
		return changed, nil
	}
	type current struct {
		gen  int64
		spec []byte
	}
	cur := make(map[string]current, len(ids))
	rows, err := q.Query(ctx, `SELECT id, spec_generation, spec FROM nodes WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE`, ids)
	if err != nil {
		return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
	}
	for rows.Next() {
		var (
			id string
			c  current
		)
		if err := rows.Scan(&id, &c.gen, &c.spec); err != nil {
			rows.Close()
			return nil, fmt.Errorf("rebuild node specs: %w", err)
		}
		cur[id] = c
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
	}
	for _, id := range ids {
		if _, ok := cur[id]; !ok {
			return nil, fmt.Errorf("rebuild spec of %s: %w", id, ErrNotFound)
		}
	}
	allocs, err := placedAllocations(ctx, q, ids)
	if err != nil {
		return nil, err
	}
	cas, err := SSHUserCAs(ctx, q)
	if err != nil {
		return nil, err
	}
	sameCA := func(a, b *gatewayv1.SshUserCa) bool { return proto.Equal(a, b) }
	var (
		changedIDs []string
		specs      []string
		gens       []int64
	)
	for _, nodeID := range ids {
		c := cur[nodeID]
		ns := &gatewayv1.NodeSpec{}
		if err := (protojson.UnmarshalOptions{DiscardUnknown: true}).Unmarshal(c.spec, ns); err != nil {
			return nil, fmt.Errorf("rebuild spec of %s: stored spec: %w", nodeID, err)
		}
		want := allocs[nodeID]
		if slices.EqualFunc(ns.GetAllocations(), want, func(a, b *gatewayv1.Allocation) bool { return proto.Equal(a, b) }) &&
			slices.EqualFunc(ns.GetSshUserCas(), cas, sameCA) {
			continue
		}
		ns.Allocations, ns.SshUserCas = want, cas
		b, err := protojson.Marshal(ns)
		if err != nil {
			return nil, err
		}
		changed[nodeID] = c.gen + 1
		changedIDs = append(changedIDs, nodeID)
		specs = append(specs, string(b))
		gens = append(gens, c.gen+1)
	}
	if len(changedIDs) == 0 {
		return changed, nil
	}
	if _, err := q.Exec(ctx, `UPDATE nodes n SET spec = u.spec::jsonb, spec_generation = u.gen, updated_at = $4
		FROM unnest($1::text[], $2::text[], $3::bigint[]) AS u(id, spec, gen) WHERE n.id = u.id`,
		changedIDs, specs, gens, now); err != nil {
		return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
	}
	if _, err := q.Exec(ctx, `UPDATE reservations r SET spec_generation = u.gen
		FROM unnest($1::text[], $2::bigint[]) AS u(id, gen)
		WHERE r.node_id = u.id AND r.state IN ('binding', 'active') AND r.spec_generation IS NULL`, changedIDs, gens); err != nil {
		return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
	}
	if err := SignNodeSpecs(ctx, q, signer, changedIDs); err != nil {
		return nil, err
	}
	if err := PokeNodes(ctx, q, now, changedIDs...); err != nil {
		return nil, err
	}
	return changed, nil
}

// placedAllocations returns the allocations of the nodes' binding and active
// reservations, by node id, each by reservation id with device indexes
// ascending.
func placedAllocations(ctx context.Context, q DBTX, nodeIDs []string) (map[string][]*gatewayv1.Allocation, error) {
	rows, err := q.Query(ctx, `SELECT r.node_id, r.id, array_agg(b.device_index ORDER BY b.device_index)
		FROM reservations r JOIN bookings b ON b.reservation_id = r.id
		WHERE r.node_id = ANY($1) AND r.state IN ('binding', 'active')
		GROUP BY r.node_id, r.id ORDER BY r.node_id, r.id`, nodeIDs)
	if err != nil {
		return nil, fmt.Errorf("allocations of nodes: %w", interpretError(err))
	}
	defer rows.Close()
	out := map[string][]*gatewayv1.Allocation{}
	for rows.Next() {
		var nodeID string
		a := &gatewayv1.Allocation{}
		if err := rows.Scan(&nodeID, &a.ReservationId, &a.DeviceIndexes); err != nil {
			return nil, err
		}
		out[nodeID] = append(out[nodeID], a)
	}
	return out, rows.Err()
}
