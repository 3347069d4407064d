DROP TABLE outbox_dead_letters;
