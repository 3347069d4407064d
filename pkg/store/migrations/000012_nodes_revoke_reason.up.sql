-- nodes.revoke_reason is the reason an operator gave when revoking the node
-- (RevokeNode): set with revoked_at by the first revocation and kept by any
-- later one, so that `nodes get` shows why a node was revoked. '' when no
-- reason was given, and for nodes revoked before this migration.
ALTER TABLE nodes ADD COLUMN revoke_reason text NOT NULL DEFAULT '';
