ALTER TABLE nodes DROP COLUMN revoke_reason;
