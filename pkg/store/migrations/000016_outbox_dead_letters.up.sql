-- outbox_dead_letters are the outbox rows the relay can never publish (a
-- payload above the NATS server's max payload, a subject NATS refuses): the
-- relay moves each here with why, in the transaction that takes it from the
-- outbox, so that the rows after it flow (pkg/outbox). They are kept for an
-- operator to read; nothing publishes them again.
CREATE TABLE outbox_dead_letters (
    id         bigserial PRIMARY KEY,
    outbox_id  bigint NOT NULL,
    subject    text NOT NULL,
    payload    bytea NOT NULL,
    created_at timestamptz NOT NULL,
    dead_at    timestamptz NOT NULL,
    reason     text NOT NULL
);
