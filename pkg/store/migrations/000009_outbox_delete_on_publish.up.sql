-- The relay now deletes outbox rows in the transaction that publishes them
-- (store.TakeOutbox: DELETE ... RETURNING, committed once NATS has flushed
-- them; a failed publish rolls the delete back). A row thus costs an insert
-- and a delete. Before, the relay stamped published_at (a non-HOT update:
-- the column is in outbox_unpublished_idx's predicate) and a prune deleted
-- the row an hour later: an insert, an update and a delete.
--
-- Every row left in the table is unpublished, so the column and the partial
-- index go; the rows already published are deleted first (the relay of this
-- version would publish them again).
DELETE FROM outbox WHERE published_at IS NOT NULL;
DROP INDEX outbox_unpublished_idx;
ALTER TABLE outbox DROP COLUMN published_at;
