ALTER TABLE events DROP COLUMN inserted_at;
