DROP INDEX reservations_in_use_idx;
ALTER TABLE pool_offers DROP COLUMN reserve_seq;
