-- Restores published_at and the index of unpublished rows. Every row in the
-- table is unpublished (published rows were deleted), so NULL is right.
ALTER TABLE outbox ADD COLUMN published_at timestamptz;
CREATE INDEX outbox_unpublished_idx ON outbox (id) WHERE published_at IS NULL;
