-- Reservations (docs/architecture.md, "Reservations"): offers of pools to tenants with a GPU quota,
-- reservations and their bookings, and usage windows.

-- pool_offers: a pool offered to a tenant, with how many GPUs the tenant may
-- hold at once in it (pending, binding and active reservations count).
CREATE TABLE pool_offers (
    pool_id     text NOT NULL REFERENCES pools (id),
    tenant_id   text NOT NULL REFERENCES tenants (id),
    gpu_quota   integer NOT NULL CHECK (gpu_quota >= 0),
    created_at  timestamptz NOT NULL,
    updated_at  timestamptz NOT NULL,
    PRIMARY KEY (pool_id, tenant_id)
);
CREATE INDEX pool_offers_tenant_idx ON pool_offers (tenant_id);

-- reservations: pending -> binding -> active -> released | expired, or
-- failed with a reason. [start_at, end_at) is the time the GPUs are held.
CREATE TABLE reservations (
    id           text PRIMARY KEY,
    tenant_id    text NOT NULL REFERENCES tenants (id),
    pool_id      text NOT NULL REFERENCES pools (id),
    gpus         integer NOT NULL CHECK (gpus > 0),
    start_at     timestamptz NOT NULL,
    end_at       timestamptz NOT NULL CHECK (end_at > start_at),
    state        text NOT NULL CHECK (state IN ('pending', 'binding', 'active', 'released', 'expired', 'failed')),
    reason       text NOT NULL DEFAULT '',
    node_id      text REFERENCES nodes (id),
    -- binding: the CDI device names the daemon reported (AllocationBound).
    binding      text[] NOT NULL DEFAULT '{}',
    -- spec_generation: the node spec generation that first carried the
    -- allocation.
    spec_generation bigint,
    request_id   text,
    created_by   text NOT NULL DEFAULT '',
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    placed_at    timestamptz,
    active_at    timestamptz,
    ended_at     timestamptz,
    UNIQUE (tenant_id, request_id)
);
CREATE INDEX reservations_pending_idx ON reservations (pool_id, created_at, id) WHERE state = 'pending';
CREATE INDEX reservations_open_idx ON reservations (end_at) WHERE state IN ('binding', 'active');
CREATE INDEX reservations_tenant_idx ON reservations (tenant_id, id);
CREATE INDEX reservations_node_idx ON reservations (node_id) WHERE node_id IS NOT NULL;

-- bookings: one row per reserved device. No two bookings of one device of
-- one node overlap in time (I1), enforced here, so racing schedulers cannot
-- double-book. A released or expired reservation's bookings end then:
-- during's upper bound moves to the end time.
CREATE TABLE bookings (
    reservation_id text NOT NULL REFERENCES reservations (id),
    node_id        text NOT NULL REFERENCES nodes (id),
    device_index   integer NOT NULL CHECK (device_index >= 0),
    during         tstzrange NOT NULL CHECK (NOT isempty(during)),
    PRIMARY KEY (reservation_id, device_index),
    CONSTRAINT bookings_no_overlap EXCLUDE USING gist (node_id WITH =, device_index WITH =, during WITH &&)
);
CREATE INDEX bookings_node_idx ON bookings (node_id);

-- usage_windows: GPU-seconds of one reservation within one hour (I8); the
-- key makes a replayed window a no-op.
CREATE TABLE usage_windows (
    reservation_id text NOT NULL REFERENCES reservations (id),
    window_start   timestamptz NOT NULL,
    tenant_id      text NOT NULL REFERENCES tenants (id),
    pool_id        text NOT NULL REFERENCES pools (id),
    gpu_seconds    bigint NOT NULL CHECK (gpu_seconds >= 0),
    created_at     timestamptz NOT NULL,
    PRIMARY KEY (reservation_id, window_start)
);
CREATE INDEX usage_windows_tenant_idx ON usage_windows (tenant_id, window_start);
