-- The first schema of better-compute. Ids are typed text ("node_…", see
-- pkg/ids); times are timestamptz; every state change happens in one
-- transaction together with its outbox row.
CREATE EXTENSION IF NOT EXISTS btree_gist;

CREATE TABLE tenants (
    id          text PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    parent_id   text REFERENCES tenants (id),
    created_at  timestamptz NOT NULL
);

CREATE TABLE api_tokens (
    id           text PRIMARY KEY,
    tenant_id    text NOT NULL REFERENCES tenants (id),
    name         text NOT NULL DEFAULT '',
    hash         bytea NOT NULL UNIQUE,
    role         text NOT NULL CHECK (role IN ('root-admin', 'tenant-admin', 'tenant-member', 'viewer')),
    expires_at   timestamptz,
    revoked_at   timestamptz,
    created_at   timestamptz NOT NULL,
    last_used_at timestamptz
);

CREATE TABLE sites (
    id          text PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    region      text NOT NULL DEFAULT '',
    created_at  timestamptz NOT NULL
);

CREATE TABLE pools (
    id               text PRIMARY KEY,
    site_id          text NOT NULL REFERENCES sites (id),
    owner_tenant_id  text NOT NULL REFERENCES tenants (id),
    name             text NOT NULL,
    kind             text NOT NULL CHECK (kind IN ('metal-host')),
    acceptance_check text NOT NULL DEFAULT 'diag.nvml' CHECK (acceptance_check IN ('diag.nvml')),
    gpu_model        text NOT NULL DEFAULT '',
    expect_gpu_count integer NOT NULL DEFAULT 0 CHECK (expect_gpu_count >= 0),
    created_at       timestamptz NOT NULL,
    UNIQUE (site_id, name)
);

CREATE TABLE join_tokens (
    id          text PRIMARY KEY,
    pool_id     text NOT NULL REFERENCES pools (id),
    hash        bytea NOT NULL UNIQUE,
    max_uses    integer NOT NULL CHECK (max_uses > 0),
    uses        integer NOT NULL DEFAULT 0 CHECK (uses >= 0 AND uses <= max_uses),
    expires_at  timestamptz NOT NULL,
    revoked_at  timestamptz,
    created_by  text NOT NULL DEFAULT '',
    created_at  timestamptz NOT NULL
);

CREATE TABLE nodes (
    id                  text PRIMARY KEY,
    pool_id             text NOT NULL REFERENCES pools (id),
    join_token_id       text REFERENCES join_tokens (id),
    provision_state     text NOT NULL CHECK (provision_state IN ('joining', 'accepting', 'adopted', 'acceptance_failed')),
    provision_reason    text NOT NULL DEFAULT '',
    hostname            text NOT NULL DEFAULT '',
    machine_id          text NOT NULL DEFAULT '',
    variant             text NOT NULL DEFAULT '',
    agent_version       text NOT NULL DEFAULT '',
    cordoned            boolean NOT NULL DEFAULT false,
    cordon_reason       text NOT NULL DEFAULT '',
    reachable           boolean NOT NULL DEFAULT false,
    gateway_id          text,
    session_id          text,
    session_epoch       bigint NOT NULL DEFAULT 0,
    boot_id             text NOT NULL DEFAULT '',
    last_seen           timestamptz,
    spec_generation     bigint NOT NULL DEFAULT 0,
    observed_generation bigint NOT NULL DEFAULT 0,
    spec                jsonb NOT NULL DEFAULT '{}',
    inventory           jsonb NOT NULL DEFAULT '{}',
    adopted_at          timestamptz,
    created_at          timestamptz NOT NULL,
    updated_at          timestamptz NOT NULL
);
CREATE INDEX nodes_pool_id_idx ON nodes (pool_id);
CREATE INDEX nodes_gateway_id_idx ON nodes (gateway_id) WHERE gateway_id IS NOT NULL;
CREATE INDEX nodes_provisioning_idx ON nodes (provision_state) WHERE provision_state IN ('joining', 'accepting');

CREATE TABLE node_certs (
    serial              text PRIMARY KEY,
    node_id             text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    public_key_sha256   bytea NOT NULL,
    not_before          timestamptz NOT NULL,
    not_after           timestamptz NOT NULL,
    revoked_at          timestamptz,
    created_at          timestamptz NOT NULL
);
CREATE INDEX node_certs_node_id_idx ON node_certs (node_id);

CREATE TABLE node_devices (
    node_id      text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    device_index integer NOT NULL CHECK (device_index >= 0),
    uuid         text NOT NULL,
    model        text NOT NULL,
    memory_bytes bigint NOT NULL DEFAULT 0,
    healthy      boolean NOT NULL DEFAULT true,
    PRIMARY KEY (node_id, device_index)
);

CREATE TABLE commands (
    id           text PRIMARY KEY,
    node_id      text NOT NULL REFERENCES nodes (id) ON DELETE CASCADE,
    kind         text NOT NULL CHECK (kind IN ('diag.nvml', 'inventory.refresh', 'logs.collect', 'node.reboot')),
    args         jsonb NOT NULL DEFAULT '{}',
    purpose      text NOT NULL DEFAULT 'user' CHECK (purpose IN ('user', 'acceptance')),
    state        text NOT NULL CHECK (state IN ('queued', 'delivered', 'running', 'succeeded', 'failed', 'expired', 'canceled')),
    retry_safe   boolean NOT NULL,
    deadline     timestamptz NOT NULL,
    result       jsonb,
    error        text NOT NULL DEFAULT '',
    created_by   text NOT NULL DEFAULT '',
    deliveries   integer NOT NULL DEFAULT 0,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL,
    delivered_at timestamptz,
    finished_at  timestamptz
);
CREATE INDEX commands_open_idx ON commands (node_id, created_at) WHERE state IN ('queued', 'delivered', 'running');
CREATE INDEX commands_node_idx ON commands (node_id, created_at);

-- outbox holds NATS messages written in the transaction that caused them;
-- the relay publishes them after commit and stamps published_at.
CREATE TABLE outbox (
    id           bigserial PRIMARY KEY,
    subject      text NOT NULL,
    payload      bytea NOT NULL,
    created_at   timestamptz NOT NULL,
    published_at timestamptz
);
CREATE INDEX outbox_unpublished_idx ON outbox (id) WHERE published_at IS NULL;

CREATE TABLE events (
    id          bigserial PRIMARY KEY,
    tenant_id   text,
    type        text NOT NULL,
    subject_id  text NOT NULL DEFAULT '',
    data        jsonb NOT NULL DEFAULT '{}',
    created_at  timestamptz NOT NULL
);
CREATE INDEX events_tenant_idx ON events (tenant_id, id);

-- leases elect one holder per role (a reconciler, the relay) until expires_at.
CREATE TABLE leases (
    name        text PRIMARY KEY,
    holder      text NOT NULL,
    expires_at  timestamptz NOT NULL,
    acquired_at timestamptz NOT NULL
);
