ALTER TABLE nodes DROP CONSTRAINT nodes_join_token_id_fkey;
ALTER TABLE nodes ADD CONSTRAINT nodes_join_token_id_fkey FOREIGN KEY (join_token_id) REFERENCES join_tokens (id);
-- Windows whose reservation retention deleted cannot reference it again.
DELETE FROM usage_windows w WHERE NOT EXISTS (SELECT 1 FROM reservations r WHERE r.id = w.reservation_id);
ALTER TABLE usage_windows ADD CONSTRAINT usage_windows_reservation_id_fkey
    FOREIGN KEY (reservation_id) REFERENCES reservations (id);
DROP INDEX join_tokens_stale_idx;
DROP INDEX node_certs_not_after_idx;
DROP INDEX usage_windows_window_start_idx;
DROP INDEX reservations_ended_idx;
DROP INDEX commands_finished_idx;
DROP TABLE event_retention;
