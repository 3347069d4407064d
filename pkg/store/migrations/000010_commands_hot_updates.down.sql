DROP INDEX commands_open_deadline_idx;
CREATE INDEX commands_open_deadline_idx ON commands (deadline)
    WHERE state IN ('queued', 'delivered', 'running') AND purpose = 'user';
DROP INDEX commands_open_idx;
CREATE INDEX commands_open_idx ON commands (node_id, created_at) WHERE state IN ('queued', 'delivered', 'running');
ALTER TABLE commands RESET (fillfactor);
ALTER TABLE commands DROP CONSTRAINT commands_finished_iff_terminal;
