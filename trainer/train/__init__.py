"""The train side: the ranks (`train_actor`, the thin Ray shell, with `RayTrainer`, the
controller's TrainerSide) and their backends (`backends`: torch, DeepSpeed, packing,
logprobs, the step), the loss and GRPO advantages, sending weights to the engines
(`weight_sync`, `weight_sync_nccl`), and the supervised warm start (`sft`).

It never imports `trainer.run`: what it reads of a recipe is `config.TrainRecipe`, and
what it reports is `outcomes`. The run imports it only through its entry points
`config`, `outcomes`, `advantages`, `train_actor`, `weight_sync` and `backends` (the
train.backend plug-in point) (tests/unit/test_layering.py). What a weight push sends is
`rollout.weight_protocol`, which the receiving engines share.
"""
