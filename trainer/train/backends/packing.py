"""Padding-free micro-batches: trajectories concatenated into one packed row per micro-batch,
with every per-token training input aligned to the row's next-token targets.

Pure torch and numpy; no model, no distributed code. Layout of one packed row of T tokens
holding sequences s = 0..S-1 (each the trajectory's prompt + response ids):

    input_ids_T      [p0 p1 r0 r1 r2 | q0 r0' r1']      two sequences, T = 8
    position_ids_T   [ 0  1  2  3  4 |  0  1   2 ]      restart at 0 per sequence
    target_ids_T     [p1 r0 r1 r2  0 | r0' r1' 0 ]      token t+1 of the same sequence
    loss_mask_T      [ 0  m0 m1 m2 0 |  m0' m1' 0]      response_mask of the target
    cu_seqlens       [0, 5, 8]                          flash-attn varlen convention

Position t of a sequence predicts its token t+1, so response token j of a trajectory with
a prompt of P tokens sits at packed position start + P + j - 1. The last position of each
sequence has no target: mask 0, target id 0 (any valid id; its logprob is never used).

Images (vision-language trajectories) travel with the row: each `TrajectoryImage` of each
sequence, its `start` moved to row coordinates, in row order, which is the order the
model fills image-token positions in (`trainer.train.backends.vision` turns them into the
model's vision inputs). Their arrays are the rollout processor's own, never re-derived.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from envs.types import Trajectory, TrajectoryImage
from trainer.train.advantages import broadcast_to_tokens


@dataclass(frozen=True, slots=True)
class PackedBatch:
    """One packed micro-batch; every `_T` tensor has the row's length T (CPU tensors)."""

    input_ids_T: torch.Tensor  # int64 model inputs: the sequences back to back
    position_ids_T: torch.Tensor  # int64, restarts at 0 at every sequence start
    target_ids_T: torch.Tensor  # int64, the token predicted at each position
    loss_mask_T: torch.Tensor  # bool, True where the target was sampled by the model
    behaviour_logprobs_T: torch.Tensor  # float32 engine logprob of the target, 0 where mask 0
    advantages_T: torch.Tensor  # float32 trajectory advantage on model targets, 0 elsewhere
    seq_index_T: torch.Tensor  # int64, which sequence (0..S-1) of this batch owns the position
    cu_seqlens: torch.Tensor  # int32, (S + 1,): start of each sequence, then T
    traj_indices: tuple[int, ...]  # position of each sequence in the list given to the packer
    prompt_lens: tuple[int, ...]  # prompt tokens of each sequence (to find its response)
    # Every sequence's images, `start` in row coordinates, in row order; () for text rows.
    images: tuple[TrajectoryImage, ...] = ()

    @property
    def num_tokens(self) -> int:
        return self.input_ids_T.numel()

    @property
    def num_seqs(self) -> int:
        return len(self.traj_indices)

    @property
    def num_model_tokens(self) -> int:
        return int(self.loss_mask_T.sum())

    @property
    def num_model_seqs(self) -> int:
        """Sequences with at least one model token (what sequence-mean losses count)."""
        counts_S = torch.zeros(self.num_seqs, dtype=torch.int64)
        counts_S.index_add_(0, self.seq_index_T, self.loss_mask_T.to(torch.int64))
        return int((counts_S > 0).sum())

    @property
    def max_seqlen(self) -> int:
        return int((self.cu_seqlens[1:] - self.cu_seqlens[:-1]).max())


def _check_advantages(trajectories: Sequence[Trajectory], advantages_B: torch.Tensor) -> None:
    if len(trajectories) == 0:
        raise ValueError("no trajectories to pack; a training step needs at least one")
    if advantages_B.ndim != 1 or advantages_B.shape[0] != len(trajectories):
        raise ValueError(f"need one advantage per trajectory: got shape "
                         f"{tuple(advantages_B.shape)} for {len(trajectories)} trajectories")
    if not torch.isfinite(advantages_B).all():
        raise ValueError("advantages must be finite; check the rewards of the batch")


def pack_trajectories(trajectories: Sequence[Trajectory], advantages_B: torch.Tensor,
                      traj_indices: Sequence[int] | None = None) -> PackedBatch:
    """Concatenate `trajectories` into one packed row (no padding, no length limit).

    `traj_indices` labels each sequence (default 0..B-1) so results can be mapped back.
    """
    _check_advantages(trajectories, advantages_B)
    labels = tuple(range(len(trajectories))) if traj_indices is None else tuple(traj_indices)
    if len(labels) != len(trajectories):
        raise ValueError(f"{len(labels)} traj_indices for {len(trajectories)} trajectories")
    parts: dict[str, list[np.ndarray]] = {k: [] for k in (
        "ids", "pos", "tgt", "mask", "behav", "seq")}
    advantages: list[torch.Tensor] = []
    images: list[TrajectoryImage] = []
    offset = 0
    for s, traj in enumerate(trajectories):
        ids = traj.input_ids().astype(np.int64)
        n, p = len(ids), len(traj.prompt_ids)
        images += _row_images(traj, n, offset)
        offset += n
        # Shift by one: the value for response token j lands where it is predicted (p + j - 1).
        mask = np.zeros(n, dtype=bool)
        mask[p - 1:n - 1] = traj.response_mask == 1
        behav = np.zeros(n, dtype=np.float32)
        behav[p - 1:n - 1] = traj.logprobs
        adv = torch.zeros(n, dtype=torch.float32)
        adv[p - 1:n - 1] = broadcast_to_tokens(
            advantages_B[s:s + 1].to(torch.float32),
            torch.from_numpy(traj.response_mask.astype(np.int64))[None])[0]
        parts["ids"].append(ids)
        parts["pos"].append(np.arange(n, dtype=np.int64))
        parts["tgt"].append(np.concatenate([ids[1:], np.zeros(1, dtype=np.int64)]))
        parts["mask"].append(mask)
        parts["behav"].append(behav)
        advantages.append(adv)
        parts["seq"].append(np.full(n, s, dtype=np.int64))
    lengths = [len(x) for x in parts["ids"]]
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    return PackedBatch(
        input_ids_T=torch.from_numpy(np.concatenate(parts["ids"])),
        position_ids_T=torch.from_numpy(np.concatenate(parts["pos"])),
        target_ids_T=torch.from_numpy(np.concatenate(parts["tgt"])),
        loss_mask_T=torch.from_numpy(np.concatenate(parts["mask"])),
        behaviour_logprobs_T=torch.from_numpy(np.concatenate(parts["behav"])),
        advantages_T=torch.cat(advantages),
        seq_index_T=torch.from_numpy(np.concatenate(parts["seq"])),
        cu_seqlens=cu_seqlens, traj_indices=labels,
        prompt_lens=tuple(len(t.prompt_ids) for t in trajectories), images=tuple(images))


def _row_images(traj: Trajectory, num_ids: int, offset: int) -> list[TrajectoryImage]:
    """`traj`'s images moved `offset` positions on (where its sequence starts in the row).

    Trajectory checks its runs on construction; this re-checks that each run lies inside
    its own sequence, because a run that spilled into the next sequence would hand that
    sequence's positions another trajectory's image features. Whether a run holds its
    `num_image_tokens` image-token ids needs the model's image-token id: vision.py checks it.
    """
    out, end = [], 0
    for image in traj.images:
        if image.start < end or image.end > num_ids:
            raise ValueError(f"trajectory {traj.task_id}/{traj.index}: image run [{image.start}, {image.end}) "
                             f"is out of order or outside its {num_ids} ids; image starts count positions "
                             "in Trajectory.input_ids() (prompt + response)")
        out.append(image.shifted(offset))
        end = image.end
    return out


def plan_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Group sequence indices into bins of at most `max_tokens` tokens: first-fit decreasing.

    Deterministic: sequences are visited longest first (ties by index), each goes to the
    first bin it fits in, else opens a new bin; bins keep creation order and list their
    indices ascending. A sequence longer than `max_tokens` cannot be split (its tokens
    attend to each other), so it gets a micro-batch of its own that exceeds the budget.
    """
    if max_tokens < 1:
        raise ValueError(f"train.micro_batch_tokens must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    used: list[int] = []
    for i in order:
        n = lengths[i]
        slot = next((b for b, u in enumerate(used) if u + n <= max_tokens), None)
        if slot is None:
            bins.append([i])
            used.append(n)
        else:
            bins[slot].append(i)
            used[slot] += n
    return [sorted(b) for b in bins]


def build_micro_batches(trajectories: Sequence[Trajectory], advantages_B: torch.Tensor,
                        max_tokens: int) -> list[PackedBatch]:
    """Packed micro-batches of at most `max_tokens` tokens each (`train.micro_batch_tokens`).

    A trajectory longer than the budget gets its own, larger micro-batch (see
    `plan_micro_batches`). `traj_indices` of every batch index into `trajectories`.
    """
    _check_advantages(trajectories, advantages_B)
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    return [pack_trajectories([trajectories[i] for i in group], advantages_B[group], group)
            for group in plan_micro_batches(lengths, max_tokens)]


def split_minibatches(num_trajectories: int, num_minibatches: int) -> list[list[int]]:
    """Contiguous, near-equal index ranges, one per optimizer step (`train.num_minibatches`).

    Contiguous in the caller's order: shuffling, if wanted, is the caller's choice.
    """
    if num_minibatches < 1 or num_minibatches > num_trajectories:
        raise ValueError(f"train.num_minibatches must be in [1, {num_trajectories}] (the "
                         f"trajectories of this step), got {num_minibatches}")
    return [chunk.tolist() for chunk in np.array_split(np.arange(num_trajectories),
                                                       num_minibatches)]


def _check_values(packed: PackedBatch, values_T: torch.Tensor) -> None:
    if values_T.shape[:1] != (packed.num_tokens,):
        raise ValueError(f"values_T has shape {tuple(values_T.shape)}, the packed batch has "
                         f"{packed.num_tokens} tokens")


def unpack_sequences(packed: PackedBatch, values_T: torch.Tensor) -> list[torch.Tensor]:
    """Per-sequence slices of a per-position tensor, in batch order (views, no copy)."""
    _check_values(packed, values_T)
    bounds = packed.cu_seqlens.tolist()
    return [values_T[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def unpack_responses(packed: PackedBatch, values_T: torch.Tensor) -> list[torch.Tensor]:
    """Per-trajectory values aligned with `response_ids` (entry j: the value where response
    token j is the target), in batch order; `packed.traj_indices` says whose each is."""
    return [seq[p - 1:len(seq) - 1] for seq, p in
            zip(unpack_sequences(packed, values_T), packed.prompt_lens)]


def unpack_to_rows(packed: PackedBatch, values_T: torch.Tensor,
                   fill: float | bool = 0) -> torch.Tensor:
    """Scatter per-position values into per-sequence rows, shape (S, max_seqlen), padded with
    `fill`. Differentiable in `values_T`; losses that reduce per sequence need this layout."""
    _check_values(packed, values_T)
    device = values_T.device
    rows_BT = torch.full((packed.num_seqs, packed.max_seqlen), fill, dtype=values_T.dtype,
                         device=device)
    index = (packed.seq_index_T.to(device), packed.position_ids_T.to(device))
    return rows_BT.index_put(index, values_T)
