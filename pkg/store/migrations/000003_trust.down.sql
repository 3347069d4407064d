DROP TRIGGER IF EXISTS nodes_spec_signature_stale ON nodes;
DROP FUNCTION IF EXISTS nodes_clear_stale_spec_signature();
ALTER TABLE nodes DROP COLUMN IF EXISTS spec_signature;
ALTER TABLE commands DROP COLUMN IF EXISTS signature;
ALTER TABLE nodes DROP COLUMN IF EXISTS revoked_at;
