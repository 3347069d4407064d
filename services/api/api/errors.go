package api

import (
	"context"
	"errors"

	"connectrpc.com/connect"

	"github.com/better-compute/better-compute/pkg/batch"
	"github.com/better-compute/better-compute/pkg/store"
)

// conflictMessages say, per unique constraint, what already exists.
var conflictMessages = map[string]string{
	store.ConstraintSiteName: "name: a site with this name already exists",
	store.ConstraintPoolName: "name: your tenant already has a pool with this name in the site",
}

// mapError turns an error of a handler into a Connect error: Connect errors
// pass through, store.ErrNotFound becomes NotFound (store messages name the
// missing row and carry no SQL), store.ErrConflict becomes AlreadyExists
// (with the message of its constraint), context ends become
// Canceled/DeadlineExceeded, and anything else Internal, wrapping err: the
// masking of service.HandlerOptions (service.PublicError) logs it and gives
// the client Unavailable when err is a failure to reach the database
// (store.IsUnavailable), "internal error" otherwise.
func mapError(err error) error {
	if err == nil {
		return nil
	}
	var cerr *connect.Error
	if errors.As(err, &cerr) {
		return cerr
	}
	switch {
	case errors.Is(err, store.ErrNotFound):
		return connect.NewError(connect.CodeNotFound, err)
	case errors.Is(err, store.ErrConflict):
		var ce *store.ConstraintError
		if errors.As(err, &ce) {
			if msg, ok := conflictMessages[ce.Constraint]; ok {
				return connect.NewError(connect.CodeAlreadyExists, errors.New(msg))
			}
		}
		return connect.NewError(connect.CodeAlreadyExists, errors.New("already exists"))
	case errors.Is(err, batch.ErrClosed):
		return connect.NewError(connect.CodeUnavailable, errors.New("the server is shutting down; retry"))
	case errors.Is(err, context.Canceled):
		return connect.NewError(connect.CodeCanceled, err)
	case errors.Is(err, context.DeadlineExceeded):
		return connect.NewError(connect.CodeDeadlineExceeded, err)
	}
	return connect.NewError(connect.CodeInternal, err)
}

// notFound is the NotFound error of a resource the caller may not see or
// that does not exist; the two are not told apart.
func notFound(kind, id string) error {
	return connect.NewError(connect.CodeNotFound, errors.New(kind+" "+id+" not found"))
}

// notFoundOr is notFound(kind, id) when err is store.ErrNotFound (the row
// is missing or outside the caller's scope), and err otherwise: the one
// answer of a store call that names one resource.
func notFoundOr(err error, kind, id string) error {
	if errors.Is(err, store.ErrNotFound) {
		return notFound(kind, id)
	}
	return err
}
