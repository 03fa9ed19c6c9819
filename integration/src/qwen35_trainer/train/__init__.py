"""The train stage: the loop, its steps and checkpoints. How a run is launched, stopped, watched
and recorded is :mod:`qwen35_trainer.supervise`.

- :mod:`.loop`: :func:`train` — process group, setup, resume, the steps, checkpoints, export;
- :mod:`.step`: one optimizer step (:func:`~.step.train_step`) and its global counts;
  :mod:`.eval`: the held-out loss and accuracy;
- :mod:`.schedule`: the learning rate of each step; the optimizer's name;
- :mod:`.checkpoint`, :mod:`.integrity`, :mod:`.safe_load`: DCP checkpoints that prove their
  integrity and load no foreign code;
- :mod:`.nonfinite`, :mod:`.determinism`: never stepping on a non-finite gradient, repeatable
  runs;
- :mod:`.replay`, :mod:`.export`: recompute one step; a checkpoint as a transformers directory.
"""

from qwen35_trainer.train.loop import Setup, StepLog, TrainResult, setup, start_processes, train

__all__ = ["Setup", "StepLog", "TrainResult", "setup", "start_processes", "train"]
