-- A command's terminal update is not HOT (it changes finished_at, which the
-- open-command indexes' predicates read), so it adds an entry to every index
-- of commands whose predicate holds for the finished row: the primary key,
-- commands_node_request_idx and commands_finished_idx. The last served only
-- retention, which now walks the primary key instead (store.DeleteOldCommands:
-- ids sort by creation time, pkg/ids, and a command finishes after it was
-- created), so a command costs one index entry fewer at its terminal update.
DROP INDEX commands_finished_idx;
