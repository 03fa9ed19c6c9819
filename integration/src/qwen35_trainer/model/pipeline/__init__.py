"""Pipeline parallelism: a stage of the model (:mod:`.stages`) and this rank's stages in torch's
schedule (:mod:`.build`)."""
