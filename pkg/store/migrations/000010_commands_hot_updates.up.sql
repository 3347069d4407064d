-- Command throughput: a command's row is written three times
-- (queued, delivered, then its terminal state). The open-command indexes
-- had the state in their predicate, so every state change was a non-HOT
-- update: a new entry in each of the table's indexes, twice per command.
--
-- "Open" is now finished_at IS NULL, which the CHECK ties to the state: only
-- the terminal update changes an indexed column, so delivery (and RUNNING)
-- can be HOT updates, and fillfactor leaves room in each page for them.
-- Queries that read open commands test finished_at IS NULL to use them.
ALTER TABLE commands ADD CONSTRAINT commands_finished_iff_terminal
    CHECK ((finished_at IS NULL) = (state IN ('queued', 'delivered', 'running')));
ALTER TABLE commands SET (fillfactor = 80);

DROP INDEX commands_open_idx;
CREATE INDEX commands_open_idx ON commands (node_id, created_at) WHERE finished_at IS NULL;
DROP INDEX commands_open_deadline_idx;
CREATE INDEX commands_open_deadline_idx ON commands (deadline) WHERE finished_at IS NULL AND purpose = 'user';
