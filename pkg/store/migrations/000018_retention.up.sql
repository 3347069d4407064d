-- Retention (docs/architecture.md, "Retention"): the controllers' retention
-- reconciler deletes, in bounded batches, the rows older than their
-- configured retention (pkg/store retention.go). This migration gives each
-- batch an index that finds its rows cheaply, lets the rows that outlive
-- others go without them, and records which events are gone.

-- event_retention records, per tenant ('' for the events of no tenant),
-- the highest event id retention deleted: every event of that tenant with
-- an id up to removed_through is gone (retention deletes events in id
-- order), none above it. The events watch refuses to resume after an id
-- below it (FailedPrecondition), and counts it as an id the watch may have
-- sent (MaxEventID). One row per tenant, so that what a tenant reads of it
-- names its own events only.
CREATE TABLE event_retention (
    tenant_id       text PRIMARY KEY,
    removed_through bigint NOT NULL CHECK (removed_through > 0)
);

-- Events and audit rows are walked in id order (their primary keys), so
-- they need no index here. The others:

-- Finished commands, oldest first. The terminal update already changes an
-- indexed column (commands_open_idx's predicate), so this adds no non-HOT
-- update, only one more index entry per command.
CREATE INDEX commands_finished_idx ON commands (finished_at) WHERE finished_at IS NOT NULL;
-- Ended reservations (released, expired, failed), oldest first.
CREATE INDEX reservations_ended_idx ON reservations (ended_at) WHERE ended_at IS NOT NULL;
-- Usage windows by hour (usage_windows_tenant_idx leads with the tenant).
CREATE INDEX usage_windows_window_start_idx ON usage_windows (window_start);
-- Node certificates by expiry.
CREATE INDEX node_certs_not_after_idx ON node_certs (not_after);
-- Join tokens by when they went stale: expiry or revocation, the earlier
-- (LEAST ignores a NULL revoked_at).
CREATE INDEX join_tokens_stale_idx ON join_tokens (LEAST(expires_at, revoked_at));

-- Usage windows are kept longer than the reservations they count (I8 sums
-- them for billing long after): they carry their tenant and pool, and no
-- longer reference the reservation.
ALTER TABLE usage_windows DROP CONSTRAINT usage_windows_reservation_id_fkey;

-- A node outlives the join token it joined with: deleting a stale token
-- clears the reference (a node whose join is removed gives its token a use
-- back only while the token exists: store.ExpireJoiningNodes).
ALTER TABLE nodes DROP CONSTRAINT nodes_join_token_id_fkey;
ALTER TABLE nodes ADD CONSTRAINT nodes_join_token_id_fkey
    FOREIGN KEY (join_token_id) REFERENCES join_tokens (id) ON DELETE SET NULL;
