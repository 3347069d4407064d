DROP INDEX nodes_join_key;
ALTER TABLE nodes DROP COLUMN join_key_sha256;
