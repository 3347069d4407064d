-- A command's terminal update changes finished_at, which the open-command
-- indexes' predicates read, so it cannot be HOT: it adds an entry to every
-- index of commands whose predicate holds for the finished row. Two of them
-- led with node_id: commands_node_idx (node_id, created_at), for a node's
-- commands, and the unique commands_request_idx (node_id, request_id)
-- WHERE request_id IS NOT NULL, for RunCommand's idempotency. One unique
-- index on (node_id, request_id) without a predicate serves both: unique
-- indexes treat NULLs as distinct, so commands without a request id never
-- conflict; QueueCommands' ON CONFLICT (node_id, request_id) WHERE
-- request_id IS NOT NULL infers it; and a node's commands (ListCommands of
-- a node, AcceptanceChecks, the cascade of a node's delete) are read by its
-- leading node_id. A command with a request id now costs one index entry
-- fewer at its insert and at its terminal update.
CREATE UNIQUE INDEX commands_node_request_idx ON commands (node_id, request_id);
DROP INDEX commands_request_idx;
DROP INDEX commands_node_idx;
