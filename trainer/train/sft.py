"""A short supervised pass on demonstrations, so an RL run starts from a policy with a
non-zero success rate (the quickstart's tiny model starts from random weights).

A demonstration is a conversation (system/user, then assistant turns with tool calls and
tool results). It is turned into ids exactly as the agent loop builds trajectories (the
continuity builder: prompt once, generated text + stop token with mask 1, observations
with mask 0), so the supervised sequences have the same layout the policy sees in RL.
Images in a demonstration (a vision-language model) stay what the chat builder made of
them: runs of ids plus the processor's arrays (`TrajectoryImage`), fed to the model through
the same vision inputs as the RL forward (`trainer.train.backends.vision`).
Plain single-process torch: this is a warm start, not the training backend.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from envs.types import Message, TrajectoryImage
from rollout.chat import ContinuityBuilder, encode
from trainer.train.backends.vision import build_vision_kwargs, check_image_runs, is_vision_language

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Demonstration:
    messages: tuple[Message, ...]  # starts with the prompt messages, then assistant/tool turns
    tools: tuple[Mapping[str, Any], ...] = ()  # OpenAI schemas shown in the prompt


@dataclass(frozen=True, slots=True)
class SftExample:
    input_ids: list[int]
    loss_mask: list[int]  # 1 on assistant tokens (the targets), 0 on prompt and observations
    # The images of input_ids (starts in its positions, in order), each run masked 0.
    images: tuple[TrajectoryImage, ...] = ()

    def __post_init__(self) -> None:
        if len(self.loss_mask) != len(self.input_ids):
            raise ValueError(f"loss_mask has {len(self.loss_mask)} entries for {len(self.input_ids)} ids")
        object.__setattr__(self, "images", tuple(self.images))  # frozen: normalised once, here
        end = 0
        for image in self.images:
            if image.start < end or image.end > len(self.input_ids) or any(self.loss_mask[image.start:image.end]):
                raise ValueError(f"image run [{image.start}, {image.end}) must lie, in order, inside the "
                                 f"{len(self.input_ids)} ids with loss mask 0 (images are never targets)")
            end = image.end


@dataclass(frozen=True, slots=True)
class SftResult:
    path: Path
    first_loss: float
    last_loss: float
    steps: int
    seconds: float


def render_assistant(message: Message) -> str:
    """An assistant turn as the model writes it: text, then Hermes tool-call blocks."""
    parts = [message.text] if message.text else []
    for call in message.tool_calls:
        body = json.dumps({"name": call.name, "arguments": dict(call.arguments)})
        parts.append(f"<tool_call>\n{body}\n</tool_call>")
    return "\n".join(parts)


def build_sft_example(tokenizer: Any, chat: ContinuityBuilder, demo: Demonstration) -> SftExample:
    """Ids, mask and images of one demonstration, built turn by turn like a rollout.

    The builder returns, for messages with images, ids that carry them (`.images`, starts
    relative to those ids: rollout.vision.PromptIds); plain lists hold none."""
    first = next((i for i, m in enumerate(demo.messages) if m.role == "assistant"), None)
    if first is None or first == 0:
        raise ValueError("a demonstration needs prompt messages followed by an assistant turn")
    prompt = chat.initial_prompt_ids(demo.messages[:first], list(demo.tools) or None)
    ids = list(prompt)
    images = list(getattr(prompt, "images", ()))
    mask = [0] * len(ids)
    rest = list(demo.messages[first:])
    while rest:
        assistant = rest.pop(0)
        if assistant.role != "assistant":
            raise ValueError(f"expected an assistant turn, got {assistant.role!r}")
        generated = encode(tokenizer, render_assistant(assistant)) + [chat.end_of_turn_id]
        ids += generated
        mask += [1] * len(generated)
        tools = []
        while rest and rest[0].role == "tool":
            tools.append(rest.pop(0))
        if tools:
            observation = chat.observation_ids(tools, generation_ended_with_eos=True)
            images += [image.shifted(len(ids)) for image in getattr(observation, "images", ())]
            ids += observation
            mask += [0] * len(observation)
    return SftExample(ids, mask, tuple(images))


def compute_sft_loss(model: torch.nn.Module, batch: Sequence[SftExample],
                     chunk_size: int = 8) -> torch.Tensor:
    """Mean next-token cross-entropy over masked (assistant) targets of `batch`.

    Examples are sorted by length and padded in chunks of `chunk_size`, so a few long
    ones do not pad the whole batch (demonstrations with and without the system prompt
    differ ~5x in length); the result is the same mean as one padded batch."""
    ordered = sorted(batch, key=lambda e: len(e.input_ids))
    total = sum(max(sum(e.loss_mask[1:]), 0) for e in ordered)
    loss = torch.zeros(())
    for i in range(0, len(ordered), chunk_size):
        loss = loss + _sum_chunk_loss(model, ordered[i:i + chunk_size])
    return loss / max(total, 1)


def _sum_chunk_loss(model: torch.nn.Module, chunk: Sequence[SftExample]) -> torch.Tensor:
    longest = max(len(e.input_ids) for e in chunk)
    ids_BT = torch.zeros(len(chunk), longest, dtype=torch.long)
    mask_BT = torch.zeros(len(chunk), longest, dtype=torch.bool)
    attn_BT = torch.zeros(len(chunk), longest, dtype=torch.long)
    for row, ex in enumerate(chunk):
        n = len(ex.input_ids)
        ids_BT[row, :n] = torch.tensor(ex.input_ids)
        mask_BT[row, :n] = torch.tensor(ex.loss_mask, dtype=torch.bool)
        attn_BT[row, :n] = 1
    logits_BTV = model(input_ids=ids_BT, attention_mask=attn_BT, **_chunk_vision_kwargs(model, chunk)).logits[:, :-1]
    targets_BT, target_mask_BT = ids_BT[:, 1:], mask_BT[:, 1:]
    losses_BT = torch.nn.functional.cross_entropy(logits_BTV.transpose(1, 2), targets_BT,
                                                  reduction="none")
    return (losses_BT * target_mask_BT).sum()


def _chunk_vision_kwargs(model: torch.nn.Module, chunk: Sequence[SftExample]) -> dict[str, torch.Tensor]:
    """The vision inputs of a padded chunk: the model fills image-token positions row by
    row (row-major over the batch), so the images go in row order, each row's in order."""
    from transformers import PreTrainedModel

    images = [image for ex in chunk for image in ex.images]
    if not images:
        return {}
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"examples with images need a Hugging Face vision-language model, got {type(model).__name__}")
    config = model.config
    for ex in chunk:
        check_image_runs(config, torch.tensor(ex.input_ids), ex.images)
    param = next(model.parameters())
    return build_vision_kwargs(config, images, param.device, param.dtype)


def run_sft(model_path: str | Path, out_dir: str | Path, examples: Sequence[SftExample], *,
            steps: int, batch_size: int = 16, lr: float = 3e-3, seed: int = 0,
            on_step: Callable[[], None] | None = None) -> SftResult:
    """Train on `examples` and save the model (with the tokenizer files) to `out_dir`;
    `on_step()` after each step (progress)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    if not examples:
        raise ValueError("no demonstrations to train on")
    start = time.monotonic()
    torch.manual_seed(seed)
    rng = random.Random(seed)
    # AutoModelForCausalLM does not map vision-language configs (Idefics3Config).
    vision = is_vision_language(AutoConfig.from_pretrained(model_path))
    auto = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    model = auto.from_pretrained(model_path, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 - s / max(steps, 1))
    first = last = float("nan")
    for step in range(steps):
        loss = compute_sft_loss(model, rng.sample(list(examples), min(batch_size, len(examples))))
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        last = loss.item()
        first = last if step == 0 else first
        if on_step is not None:
            on_step()
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        for item in Path(model_path).iterdir():  # tokenizer, chat template, build info
            if not item.name.startswith(("model", "config.json")) and item.is_file():
                shutil.copy2(item, tmp / item.name)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("sft: %d steps, loss %.3f -> %.3f, %.1fs", steps, first, last, time.monotonic() - start)
    return SftResult(out, first, last, steps, time.monotonic() - start)


def demonstrations_key(model_path: str | Path, demos: Sequence[Demonstration], steps: int) -> str:
    """Cache key of a warm-started model: base model, demonstrations and step count."""
    digest = hashlib.sha256(str(Path(model_path).resolve()).encode())
    digest.update(str(steps).encode())
    for demo in demos:
        digest.update(json.dumps([m.to_template() for m in demo.messages], sort_keys=True).encode())
        digest.update(json.dumps(list(demo.tools), sort_keys=True).encode())
    return digest.hexdigest()[:12]
