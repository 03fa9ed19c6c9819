"""LoRA: the adapters and what trains in full (:mod:`.adapters`), PEFT's adapter folder read
(:mod:`.peft_import`) and written (:mod:`.peft_export`)."""
