-- The W3C trace context (traceparent, docs/architecture.md "Traces") of
-- the request that wrote a command or an outbox row, '' when none: the
-- relay publishes an outbox row's in a NATS header, and the gateway starts
-- the span of a command's delivery from the command's, so that one trace
-- crosses the API, the outbox, NATS, the gateway and the daemon.
ALTER TABLE commands ADD COLUMN traceparent text NOT NULL DEFAULT '';
ALTER TABLE outbox ADD COLUMN traceparent text NOT NULL DEFAULT '';
