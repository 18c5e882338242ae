"""GRPO advantages: each sample's reward normalised within its group of G rollouts of
one task, given to every trajectory (segment) of that sample, then spread over the
trajectory's model tokens. Plain torch; no Ray, no engine."""

from __future__ import annotations

import numpy as np
import torch

from envs.types import Group
from trainer.train.config import LossConfig


def _check_group(rewards_G: torch.Tensor) -> None:
    if rewards_G.ndim != 1:
        raise ValueError(f"rewards_G must be 1-D (one reward per trajectory of a group), "
                         f"got shape {tuple(rewards_G.shape)}")
    if rewards_G.numel() < 2:
        raise ValueError(f"GRPO needs >= 2 trajectories per group to form a baseline, got "
                         f"{rewards_G.numel()}; set train.group_size >= 2")


def compute_grpo_advantages(rewards_G: torch.Tensor, std_norm: bool, leave_one_out: bool,
                            eps: float) -> torch.Tensor:
    """Advantage of each trajectory of one group.

    Baseline: the group mean, so A_i = r_i - mean(r). With `leave_one_out` the baseline of
    i is the mean of the other G-1 rewards: A_i = r_i - mean_{j!=i} r_j, which equals
    G/(G-1) * (r_i - mean(r)).
    With `std_norm` the centred value (plain or leave-one-out) is divided by
    (std(r) + eps), where std is the population std of all G rewards (unbiased=False,
    i.e. divided by G, not G-1). So leave_one_out + std_norm gives
    (r_i - mean_{j!=i} r_j) / (std(r) + eps); no leave-one-out std is used.
    A zero-variance group gets all-zero advantages either way.
    """
    _check_group(rewards_G)
    r_G = rewards_G if rewards_G.is_floating_point() else rewards_G.to(torch.float32)
    num = r_G.numel()
    centred_G = r_G - r_G.mean()
    if leave_one_out:
        centred_G = centred_G * (num / (num - 1))
    if std_norm:
        centred_G = centred_G / (r_G.std(correction=0) + eps)
    return centred_G


def compute_group_advantages(group: Group, cfg: LossConfig) -> np.ndarray:
    """float32 advantage per row of `group.trajectories`: the GRPO advantage of each of the
    G samples (baseline and std over samples, `group.rewards()`), given to every segment
    of that sample. A sample split into k segments by a history rewrite is one sample of
    the baseline, not k, so rewriting cannot shift the group's mean. Samples cut by the
    group's deadline (`Group.in_baseline` false) are outside the baseline and get 0."""
    kept_G = group.in_baseline()
    adv_G = np.zeros(len(kept_G), dtype=np.float32)
    adv_G[kept_G] = compute_grpo_advantages(torch.as_tensor(group.rewards()[kept_G]),
                                            cfg.adv_std_norm, cfg.adv_leave_one_out,
                                            cfg.adv_eps).numpy()
    return adv_G[group.sample_of_rows()]


def broadcast_to_tokens(advantages_B: torch.Tensor, response_mask_BT: torch.Tensor) -> torch.Tensor:
    """The trajectory-level advantage on every model token (mask 1), 0 elsewhere (shape BT).

    Environment tokens (tool output, template glue) get 0 so they can never carry signal,
    even if a caller forgets to mask the loss.
    """
    if advantages_B.ndim != 1 or response_mask_BT.ndim != 2:
        raise ValueError(f"expected advantages_B 1-D and response_mask_BT 2-D, got shapes "
                         f"{tuple(advantages_B.shape)} and {tuple(response_mask_BT.shape)}")
    if advantages_B.shape[0] != response_mask_BT.shape[0]:
        raise ValueError(f"{advantages_B.shape[0]} advantages for {response_mask_BT.shape[0]} "
                         f"sequences; pass one advantage per row of response_mask_BT")
    adv_BT = advantages_B[:, None].expand(response_mask_BT.shape)
    return torch.where(response_mask_BT != 0, adv_BT, torch.zeros_like(adv_BT))
