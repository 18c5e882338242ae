"""Trainer: the top of the stack, in two subpackages.

`trainer.run` is the composition root and everything the driver runs: the composed config
and its checks, the resource pools, the controller and its seams, metrics, checkpoints,
export. `trainer.train` is the train side: the ranks and their backends, the loss and
advantages, and sending weights to the engines. `trainer.main` is the entry point
(`python -m trainer.main recipe=...`); `trainer.train` never imports `trainer.run`
(tests/unit/test_layering.py).
"""
