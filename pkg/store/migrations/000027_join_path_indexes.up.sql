-- Indexes that the join path wrote and no query reads.
--
-- node_certs_public_key (migration 000013) found the node a key joined as;
-- nodes.join_key_sha256 and its unique index (migration 000015) do that now,
-- so every certificate, joined or renewed, wrote an entry nothing read.
DROP INDEX node_certs_public_key;

-- nodes_gateway_id_idx served one statement, ResetGatewaySessions, which
-- clears a gateway's sessions once when it starts (a scan of nodes there is
-- fine). Because gateway_id was indexed, every session open and close
-- updated a node's row with a new entry in each of nodes' indexes; without
-- it they change no indexed column and are heap-only (HOT) updates.
DROP INDEX nodes_gateway_id_idx;
