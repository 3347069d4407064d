package store

import (
	"context"
	"encoding/json"
	"fmt"
	"time"
)

// FailNodeReservations ends the placed reservations (binding or active) of
// node nodeID at now as failed with reason: their bookings end at now
// (bookings that had not started are deleted), so usage stops there and the
// GPUs stop counting against quota; the node's spec drops the allocations
// (signed by signer) and a reservation.failed event is written for each. It
// is for an operator's revocation of the node, never for a loss of
// connectivity (I5). It returns the ids of the reservations it ended. Call
// it in the revocation's transaction.
func FailNodeReservations(ctx context.Context, q DBTX, signer *IntentSigner, now time.Time, nodeID, reason string) ([]string, error) {
	rows, err := q.Query(ctx, `UPDATE reservations SET state = 'failed', reason = $3, ended_at = $2, updated_at = $2
		WHERE node_id = $1 AND state IN ('binding', 'active') RETURNING id, tenant_id, state`, nodeID, now, reason)
	if err != nil {
		return nil, fmt.Errorf("fail reservations of node %s: %w", nodeID, interpretError(err))
	}
	var (
		ids    []string
		events []ReservationEvent
	)
	for rows.Next() {
		var id, tenant, state string
		if err := rows.Scan(&id, &tenant, &state); err != nil {
			rows.Close()
			return nil, err
		}
		data, err := json.Marshal(map[string]string{"reservationId": id, "nodeId": nodeID, "reason": reason})
		if err != nil {
			rows.Close()
			return nil, err
		}
		ids = append(ids, id)
		events = append(events, ReservationEvent{TenantID: tenant, Type: EventReservationFailed, SubjectID: id, Data: data})
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("fail reservations of node %s: %w", nodeID, interpretError(err))
	}
	if len(ids) == 0 {
		return nil, nil
	}
	if err := endBookings(ctx, q, now, ids); err != nil {
		return nil, err
	}
	if _, err := RebuildNodeSpecs(ctx, q, signer, now, []string{nodeID}); err != nil {
		return nil, err
	}
	if err := InsertReservationEvents(ctx, q, now, events); err != nil {
		return nil, err
	}
	return ids, nil
}
