package store

// Errors: the sentinels store functions return, and the one place that
// turns driver errors into them (interpretError, queryErr).

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Sentinel errors returned by store functions; wrap-compare with errors.Is.
var (
	// ErrNotFound means the row does not exist (or is not visible).
	ErrNotFound = errors.New("not found")
	// ErrConflict means a unique or exclusion constraint refused the change.
	ErrConflict = errors.New("conflict")
	// ErrStale means the row changed under an optimistic update.
	ErrStale = errors.New("stale")
)

// IsRetryable reports whether err is a serialization failure or a deadlock
// (SQLSTATE 40001, 40P01): the transaction was rolled back and may simply
// run again, as InTx does.
func IsRetryable(err error) bool {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code == "40001" || pe.Code == "40P01"
	}
	return false
}

// interpretError turns driver errors into sentinels; other errors pass
// through unchanged.
func interpretError(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%w: %w", ErrNotFound, err)
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch pe.Code {
		case "23505", "23P01": // unique_violation, exclusion_violation
			return &ConstraintError{Constraint: pe.ConstraintName, err: err}
		}
	}
	return err
}

// ConstraintError is a unique or exclusion violation of a named constraint.
// It matches ErrConflict under errors.Is.
type ConstraintError struct {
	// Constraint is the constraint's name in the schema.
	Constraint string
	err        error
}

func (e *ConstraintError) Error() string {
	return "conflict on " + e.Constraint + ": " + e.err.Error()
}

// Is makes errors.Is(err, ErrConflict) true.
func (e *ConstraintError) Is(target error) bool { return target == ErrConflict }

// Unwrap returns the driver error.
func (e *ConstraintError) Unwrap() error { return e.err }

// IsUnavailable reports whether err is a failure to reach the database
// rather than an answer from it, so that the call may succeed when retried
// (callers map it to Unavailable): a failed connect, including one that
// timed out or found no host (*pgconn.ConnectError, also as a pool's
// failed acquire), a network error on an open connection (net.Error, not
// the caller's own context ending), or a server that refuses work while
// shutting down or starting (SQLSTATE class 08, 57P01–57P03).
func IsUnavailable(err error) bool {
	if err == nil {
		return false
	}
	var ce *pgconn.ConnectError
	if errors.As(err, &ce) {
		return true
	}
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		switch {
		case strings.HasPrefix(pe.Code, "08"), // connection_exception
			pe.Code == "57P01", // admin_shutdown
			pe.Code == "57P02", // crash_shutdown
			pe.Code == "57P03": // cannot_connect_now
			return true
		}
		return false
	}
	// The context errors are net.Errors too (Timeout): a call whose own
	// deadline passed is DeadlineExceeded, not Unavailable.
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var ne net.Error
	return errors.As(err, &ne)
}

// IsConstraint reports whether err is a violation of the named constraint.
func IsConstraint(err error, name string) bool {
	var ce *ConstraintError
	return errors.As(err, &ce) && ce.Constraint == name
}

// queryErr names what a query was about and interprets err: no rows become
// ErrNotFound without the driver error (so that InTx does not wrap it
// twice), constraint violations become ConstraintError.
func queryErr(what string, err error) error {
	if errors.Is(err, pgx.ErrNoRows) {
		return fmt.Errorf("%s: %w", what, ErrNotFound)
	}
	return fmt.Errorf("%s: %w", what, interpretError(err))
}
