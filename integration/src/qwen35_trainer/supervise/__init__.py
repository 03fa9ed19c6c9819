"""The run's supervision: how its processes start, stop and restart, and how it is watched.

- :mod:`.launch`: the built-in local launch (PyTorch's elastic agent), a worker's exit, the
  default run folder's name;
- :mod:`.preemption`: SIGTERM / SIGUSR1 finish the step, save and stop, agreed by every rank;
- :mod:`.console`: what rank 0 prints (the run's header, one line or a bar per step);
- :mod:`.metrics`: a step's record (:class:`~.metrics.StepLog`) and its fields;
- :mod:`.run_folder`: ``recipe.yaml``, ``metrics.jsonl`` (one record per step across restarts),
  ``loss.png``, the logs;
- :mod:`.trackers`: ``train.trackers`` (TensorBoard, W&B, MLflow), continued across restarts.

:mod:`qwen35_trainer.train` runs the steps; this package only watches and records them.
"""
