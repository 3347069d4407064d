DROP INDEX IF EXISTS commands_open_deadline_idx;
DROP INDEX IF EXISTS commands_request_idx;
ALTER TABLE commands DROP COLUMN IF EXISTS request_id;
