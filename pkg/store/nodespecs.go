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

	"github.com/jackc/pgx/v5"
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
	if len(ids) == 0 {
		return map[string]int64{}, nil
	}
	cur := make(map[string]lockedSpec, len(ids))
	rows, err := q.Query(ctx, `SELECT id, spec_generation, spec FROM nodes WHERE id = ANY($1) ORDER BY id FOR NO KEY UPDATE`, ids)
	if err != nil {
		return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
	}
	for rows.Next() {
		var (
			id string
			c  lockedSpec
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
	return rebuildLockedSpecs(ctx, q, signer, now, ids, cur)
}

// lockedSpec is a node's spec generation and stored spec, read with the
// node locked (FOR NO KEY UPDATE) in the caller's transaction.
type lockedSpec struct {
	gen  int64
	spec []byte
}

// rebuildLockedSpecs is RebuildNodeSpecs of ids (sorted, distinct), each
// locked by the caller with its current spec in cur.
func rebuildLockedSpecs(ctx context.Context, q DBTX, signer *IntentSigner, now time.Time, ids []string,
	cur map[string]lockedSpec) (map[string]int64, error) {
	changed := map[string]int64{}
	allocs, unnumbered, cas, err := placedAllocations(ctx, q, ids)
	if err != nil {
		return nil, err
	}
	sameCA := func(a, b *gatewayv1.SshUserCa) bool { return proto.Equal(a, b) }
	var (
		changedIDs []string
		specs      []string
		gens       []int64
		sigs       [][]byte // by changedIDs; nil without a signer
		numbering  bool
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
		if signer != nil {
			// Signed as the gateway delivers it: DesiredStateMessage of the
			// stored spec, which Postgres keeps as jsonb (keys reordered,
			// spacing dropped) and which parses back to what b parses to.
			m, err := DesiredStateMessage(c.gen+1, b, nil)
			if err != nil {
				return nil, fmt.Errorf("rebuild spec of %s: %w", nodeID, err)
			}
			sig, err := signer.SpecSignature(nodeID, m)
			if err != nil {
				return nil, fmt.Errorf("sign the spec of node %s: %w", nodeID, err)
			}
			sigs = append(sigs, sig)
		}
		changed[nodeID] = c.gen + 1
		changedIDs = append(changedIDs, nodeID)
		specs = append(specs, string(b))
		gens = append(gens, c.gen+1)
		numbering = numbering || unnumbered[nodeID]
	}
	if len(changedIDs) == 0 {
		return changed, nil
	}
	// The signature in the same update: the nodes_spec_signature_stale
	// trigger keeps a signature set with the spec and clears the old one
	// when there is none (no signer).
	if sigs == nil {
		sigs = make([][]byte, len(changedIDs))
	}
	if _, err := q.Exec(ctx, `UPDATE nodes n SET spec = u.spec::jsonb, spec_generation = u.gen, spec_signature = u.sig,
			updated_at = $5
		FROM unnest($1::text[], $2::text[], $3::bigint[], $4::bytea[]) AS u(id, spec, gen, sig) WHERE n.id = u.id`,
		changedIDs, specs, gens, sigs, now); err != nil {
		return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
	}
	// Only when a reservation in a new spec has no generation yet (its
	// placement, PlaceReservations, records its own).
	if numbering {
		if _, err := q.Exec(ctx, `UPDATE reservations r SET spec_generation = u.gen
			FROM unnest($1::text[], $2::bigint[]) AS u(id, gen)
			WHERE r.node_id = u.id AND r.state IN ('binding', 'active') AND r.spec_generation IS NULL`, changedIDs, gens); err != nil {
			return nil, fmt.Errorf("rebuild node specs: %w", interpretError(err))
		}
	}
	if err := PokeNodes(ctx, q, now, changedIDs...); err != nil {
		return nil, err
	}
	return changed, nil
}

// placedAllocations returns the allocations of the nodes' binding and active
// reservations, by node id, each by reservation id with device indexes
// ascending; the nodes with such a reservation that has no spec generation
// yet; and the deployment's SSH user CAs (SSHUserCAs). It is one round trip
// (a pgx.Batch of the two reads).
func placedAllocations(ctx context.Context, q DBTX, nodeIDs []string) (map[string][]*gatewayv1.Allocation,
	map[string]bool, []*gatewayv1.SshUserCa, error) {
	batch := &pgx.Batch{}
	batch.Queue(`SELECT r.node_id, r.id, r.spec_generation IS NULL, array_agg(b.device_index ORDER BY b.device_index)
		FROM reservations r JOIN bookings b ON b.reservation_id = r.id
		WHERE r.node_id = ANY($1) AND r.state IN ('binding', 'active')
		GROUP BY r.node_id, r.id ORDER BY r.node_id, r.id`, nodeIDs)
	batch.Queue(sshUserCAsSQL)
	br := q.SendBatch(ctx, batch)
	defer func() { _ = br.Close() }()
	rows, err := br.Query()
	if err != nil {
		return nil, nil, nil, fmt.Errorf("allocations of nodes: %w", interpretError(err))
	}
	out := map[string][]*gatewayv1.Allocation{}
	unnumbered := map[string]bool{}
	for rows.Next() {
		var (
			nodeID string
			none   bool
		)
		a := &gatewayv1.Allocation{}
		if err := rows.Scan(&nodeID, &a.ReservationId, &none, &a.DeviceIndexes); err != nil {
			rows.Close()
			return nil, nil, nil, err
		}
		out[nodeID] = append(out[nodeID], a)
		unnumbered[nodeID] = unnumbered[nodeID] || none
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, nil, nil, fmt.Errorf("allocations of nodes: %w", interpretError(err))
	}
	rows, err = br.Query()
	if err != nil {
		return nil, nil, nil, queryErr("ssh user CAs", err)
	}
	cas, err := collectSSHUserCAs(rows)
	if err != nil {
		return nil, nil, nil, queryErr("ssh user CAs", err)
	}
	if err := br.Close(); err != nil {
		return nil, nil, nil, fmt.Errorf("allocations of nodes: %w", interpretError(err))
	}
	return out, unnumbered, cas, nil
}
