CREATE INDEX commands_finished_idx ON commands (finished_at) WHERE finished_at IS NOT NULL;
