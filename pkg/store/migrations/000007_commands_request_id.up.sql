-- Commands run by users: RunCommand is idempotent by request id.
--
-- commands.request_id is the caller's idempotency key (NULL when it gave
-- none); a retry of RunCommand with the same key on the same node returns
-- the command it queued first instead of queuing another.
ALTER TABLE commands ADD COLUMN request_id text;
CREATE UNIQUE INDEX commands_request_idx ON commands (node_id, request_id) WHERE request_id IS NOT NULL;

-- The command expiry reconciler finds open user commands past their
-- deadline.
CREATE INDEX commands_open_deadline_idx ON commands (deadline)
    WHERE state IN ('queued', 'delivered', 'running') AND purpose = 'user';
