-- pool_offers.reserve_seq: a counter every reservation made under the offer
-- increments, in the statement of pkg/store CreateReservation that checks
-- the quota. Its UPDATE takes the offer's row lock, which serialises one
-- tenant's Reserves of one pool; the statement compares the value it
-- incremented with the one its snapshot read, so that a Reserve that waited
-- for another's commit (and whose snapshot misses that one's GPUs) knows it
-- and checks the quota again in a statement that sees them.
ALTER TABLE pool_offers ADD COLUMN reserve_seq bigint NOT NULL DEFAULT 0;

-- The GPUs a tenant holds in a pool (its pending, binding and active
-- reservations), which each Reserve sums, read from the index alone
-- instead of through every reservation the tenant ever made.
CREATE INDEX reservations_in_use_idx ON reservations (tenant_id, pool_id) INCLUDE (gpus)
    WHERE state IN ('pending', 'binding', 'active');
