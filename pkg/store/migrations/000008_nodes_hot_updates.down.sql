ALTER TABLE nodes RESET (fillfactor, toast_tuple_target);
