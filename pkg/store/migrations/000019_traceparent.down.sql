ALTER TABLE outbox DROP COLUMN traceparent;
ALTER TABLE commands DROP COLUMN traceparent;
