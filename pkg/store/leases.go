package store

// Leases elect one holder per role (a reconciler, the scheduler) until they
// expire; gateways' presence rows live in the same table (liveness.go).

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// LeaseRow is a row of leases: who holds the role name until when.
type LeaseRow struct {
	Name       string
	Holder     string
	ExpiresAt  time.Time
	AcquiredAt time.Time
}

// TryAcquireLease takes the lease name for holder until now+ttl when it is
// free, expired (expires_at <= now) or already held by holder, in which case
// it is renewed and keeps its acquired_at. It is one UPSERT, so two callers
// racing for a free lease cannot both win. It reports whether holder holds
// the lease afterwards.
func TryAcquireLease(ctx context.Context, q DBTX, name, holder string, now time.Time, ttl time.Duration) (bool, error) {
	var got string
	err := q.QueryRow(ctx, `INSERT INTO leases (name, holder, expires_at, acquired_at) VALUES ($1, $2, $3, $4)
		ON CONFLICT (name) DO UPDATE SET
			holder = EXCLUDED.holder,
			expires_at = EXCLUDED.expires_at,
			acquired_at = CASE WHEN leases.holder = EXCLUDED.holder THEN leases.acquired_at ELSE EXCLUDED.acquired_at END
		WHERE leases.holder = EXCLUDED.holder OR leases.expires_at <= EXCLUDED.acquired_at
		RETURNING holder`, name, holder, now.Add(ttl), now).Scan(&got)
	if errors.Is(err, pgx.ErrNoRows) {
		return false, nil // held by someone else and not expired
	}
	if err != nil {
		return false, fmt.Errorf("acquire lease %s: %w", name, interpretError(err))
	}
	return got == holder, nil
}

// ReleaseLease gives up the lease name if holder holds it, so that another
// holder can take it at once; it reports whether a lease was released.
func ReleaseLease(ctx context.Context, q DBTX, name, holder string) (bool, error) {
	tag, err := q.Exec(ctx, `DELETE FROM leases WHERE name = $1 AND holder = $2`, name, holder)
	if err != nil {
		return false, fmt.Errorf("release lease %s: %w", name, interpretError(err))
	}
	return tag.RowsAffected() > 0, nil
}

// GetLease returns the lease name. Errors: ErrNotFound when nobody has taken
// it (or it was released).
func GetLease(ctx context.Context, q DBTX, name string) (LeaseRow, error) {
	var l LeaseRow
	err := q.QueryRow(ctx, `SELECT name, holder, expires_at, acquired_at FROM leases WHERE name = $1`, name).
		Scan(&l.Name, &l.Holder, &l.ExpiresAt, &l.AcquiredAt)
	if errors.Is(err, pgx.ErrNoRows) {
		return LeaseRow{}, fmt.Errorf("lease %s: %w", name, ErrNotFound)
	}
	if err != nil {
		return LeaseRow{}, fmt.Errorf("lease %s: %w", name, interpretError(err))
	}
	return l, nil
}
