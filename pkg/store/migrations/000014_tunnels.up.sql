-- Tunnels (docs/architecture.md, "Tunnels").
--
-- tunnel_tickets are the exec tickets the API issues: a ticket opens one
-- tunnel (consumed_at is set once, atomically), and the row then stands for
-- the open tunnel until closed_at, re-authorized every minute
-- (authorized_at), so that the limits per node and per token count the
-- tunnels open across every API replica (a row not re-authorized for two
-- minutes belongs to a replica that died and counts no more).
CREATE TABLE tunnel_tickets (
	id text PRIMARY KEY,
	node_id text NOT NULL REFERENCES nodes (id),
	purpose text NOT NULL CHECK (purpose IN ('shell', 'ssh')),
	tenant_id text NOT NULL REFERENCES tenants (id),
	token_id text NOT NULL REFERENCES api_tokens (id),
	reservation_id text REFERENCES reservations (id),
	created_at timestamptz NOT NULL,
	expires_at timestamptz NOT NULL,
	consumed_at timestamptz,
	authorized_at timestamptz,
	closed_at timestamptz,
	close_reason text NOT NULL DEFAULT ''
);
CREATE INDEX tunnel_tickets_open_node ON tunnel_tickets (node_id) WHERE consumed_at IS NOT NULL AND closed_at IS NULL;
CREATE INDEX tunnel_tickets_open_token ON tunnel_tickets (token_id) WHERE consumed_at IS NOT NULL AND closed_at IS NULL;

-- ssh_user_cas are the SSH user CAs every NodeSpec carries (name
-- 'break-glass' or 'sandbox', public key in authorized_keys format); the
-- controllers keep them equal to the PKI directory's.
CREATE TABLE ssh_user_cas (
	name text PRIMARY KEY CHECK (name IN ('break-glass', 'sandbox')),
	public_key text NOT NULL,
	updated_at timestamptz NOT NULL
);

-- gateways are the gateway replicas that have run, with the URL of their
-- control listener (GatewayControlService), where the API opens tunnels.
-- Whether one is alive is its presence (leases "gateway.<id>").
CREATE TABLE gateways (
	id text PRIMARY KEY,
	control_url text NOT NULL,
	updated_at timestamptz NOT NULL
);
