CREATE INDEX commands_node_idx ON commands (node_id, created_at);
CREATE UNIQUE INDEX commands_request_idx ON commands (node_id, request_id) WHERE request_id IS NOT NULL;
DROP INDEX commands_node_request_idx;
