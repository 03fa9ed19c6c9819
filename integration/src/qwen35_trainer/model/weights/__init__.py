"""Where a parameter's value comes from and where it goes: a transformers checkpoint folder read
straight into this rank's shards (:mod:`.files`, :mod:`.adapter`, :mod:`.stored`, :mod:`.load`),
the name-seeded initialisation (:mod:`.init`), the shard arithmetic they share (:mod:`.shards`)
and the export back to a checkpoint folder without gathering (:mod:`.export`)."""
