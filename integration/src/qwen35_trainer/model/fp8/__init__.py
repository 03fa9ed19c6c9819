"""The frozen base in block-scaled FP8: which modules hold it and how they compute
(:mod:`.hold`), and where their bytes and scales come from (:mod:`.load`)."""
