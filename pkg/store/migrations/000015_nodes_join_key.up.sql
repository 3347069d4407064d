-- nodes.join_key_sha256 is the SHA-256 of the public key a node joined
-- with: one key joins as one node at most (a retried Join with it is
-- answered with that node). Nodes joined before this migration take the key
-- of their first certificate; of two nodes that joined with one key, the
-- older keeps it.
ALTER TABLE nodes ADD COLUMN join_key_sha256 bytea;
UPDATE nodes n SET join_key_sha256 = k.key
FROM (
	SELECT DISTINCT ON (first.key) first.node_id, first.key
	FROM (
		SELECT DISTINCT ON (c.node_id) c.node_id, c.public_key_sha256 AS key, c.created_at
		FROM node_certs c ORDER BY c.node_id, c.created_at
	) AS first
	JOIN nodes o ON o.id = first.node_id
	ORDER BY first.key, o.created_at, o.id
) AS k
WHERE n.id = k.node_id;
CREATE UNIQUE INDEX nodes_join_key ON nodes (join_key_sha256);
