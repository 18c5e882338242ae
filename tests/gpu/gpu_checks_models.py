"""What the GPU checks (tests/gpu/run_gpu_checks.py) share: the run's settings, Qwen3 shapes,
random models and trajectories, the Hugging Face reference logprobs of an unpacked forward,
peak-memory readings and the pass/fail bookkeeping of one check.

Imports torch, transformers, numpy, PyYAML (a transformers dependency) and the sluice
modules the trainer itself uses; nothing else.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from envs.types import Trajectory

ROOT = Path(__file__).resolve().parents[2]
SWE_RECIPE = ROOT / "recipes" / "swe_grpo.yaml"


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """One run of the script: `dry` is the CPU-safe mode (`--tiny`): tiny shapes, short
    sequences, the same code paths."""

    device: str  # cuda or cpu
    dry: bool

    @property
    def dtype(self) -> torch.dtype:
        """bf16 on cuda (what training runs in), fp32 on cpu (bf16 matmuls are slow there)."""
        return torch.bfloat16 if self.device == "cuda" else torch.float32


class Verdict:
    """The failed expectations of one check, each with its figures in the message: a
    check reports every one instead of stopping at the first."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def expect(self, ok: bool, message: str) -> bool:
        if not ok:
            self.failures.append(message)
        return ok

    def result(self, **figures: Any) -> dict[str, Any]:
        return {"ok": not self.failures, "failures": list(self.failures), **figures}


def skipped(reason: str, **figures: Any) -> dict[str, Any]:
    """A check that could not run here: ok (nothing failed), flagged, with the reason."""
    return {"ok": True, "skipped": True, "reason": reason, "failures": [], **figures}


# --- shapes (config.json fields of Qwen3 models; vocabulary, heads and head_dim as shipped) --

# Qwen3-8B's own config.json: tests/model_configs.py (36 layers, 40,960 positions).
QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
             "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
             "rope_theta": 1000000, "max_position_embeddings": 40960,
             "tie_word_embeddings": True, "num_hidden_layers": 28}
# The dry mode's stand-in for both: GQA (4 query heads over 2 KV heads), a vocabulary large
# enough that unchunked logits dominate memory (Qwen3's 151,936 would only cost CPU time),
# few positions so that YaRN acts on a few hundred tokens.
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 32768, "rope_theta": 1000000,
        "max_position_embeddings": 320, "tie_word_embeddings": False, "num_hidden_layers": 2}
TINY_ORIGINAL_POSITIONS = 256  # YaRN's original_max_position_embeddings in the dry mode


def qwen3_8b_config() -> dict[str, Any]:
    """Qwen3-8B's config.json as the tests know it (tests/model_configs.py)."""
    from model_configs import QWEN3_8B

    return dict(QWEN3_8B)


def tiny_like(config: Mapping[str, Any]) -> dict[str, Any]:
    """`config` (a config.json) with TINY's sizes and its own layer count: the dry mode's
    version of a real model's shape."""
    keep = {k: config[k] for k in ("num_hidden_layers", "model_type", "architectures")
            if k in config}
    return {**dict(config), **TINY, **keep}


def recipe_rope_scaling(dry: bool) -> dict[str, Any]:
    """model.rope_scaling of recipes/swe_grpo.yaml (YaRN x2 over 32,768 positions); in the
    dry mode over TINY_ORIGINAL_POSITIONS instead, so a few hundred tokens pass them."""
    import yaml

    scaling = dict(yaml.safe_load(SWE_RECIPE.read_text())["model"]["rope_scaling"])
    if dry:
        scaling["original_max_position_embeddings"] = TINY_ORIGINAL_POSITIONS
    return scaling


def model_config(shape: Mapping[str, Any], num_layers: int | None = None,
                 overrides: Mapping[str, Any] | None = None) -> Any:
    """A transformers Qwen3Config of `shape`, with `overrides` (rollout.rope) applied as the
    trainer applies them."""
    from transformers import Qwen3Config

    from rollout.rope import apply_config_overrides

    fields = {k: v for k, v in shape.items() if k not in ("model_type", "architectures",
                                                          "torch_dtype", "rope_scaling")}
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    config = Qwen3Config(**fields)
    if overrides:
        apply_config_overrides(config, overrides)
    return config


def build_random_model(config: Any, dtype: torch.dtype, device: str, attn: str,
                       checkpointing: bool = False, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised causal LM, initialised on `device` (fast on a GPU), with the
    trainer's model settings: dropout off, no KV cache, non-reentrant checkpointing."""
    from transformers import AutoModelForCausalLM

    from trainer.train.backends.logprobs import register_packed_sdpa

    register_packed_sdpa()
    torch.manual_seed(seed)
    config.use_cache = False
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def save_random_model(folder: Path, shape: Mapping[str, Any], dtype: torch.dtype, device: str,
                      seed: int = 0) -> Path:
    """A random model of `shape` saved as a Hugging Face folder (what model.path names).
    Not `model.save_pretrained`: where accelerate and deepspeed are installed it imports
    deepspeed (to unwrap a DeepSpeedEngine), which the dry mode must not."""
    from safetensors.torch import save_file

    model = build_random_model(model_config(shape), dtype, device, "sdpa", seed=seed)
    model.config.save_pretrained(folder)
    state = dict(model.state_dict())
    if model.config.tie_word_embeddings:  # stored once, as Qwen3-0.6B ships it
        state.pop("lm_head.weight")
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    del model, state
    free_memory()
    return folder


def load_reference_model(folder: Path, dtype: torch.dtype, device: str,
                         overrides: Mapping[str, Any] | None = None) -> torch.nn.Module:
    """The model of `folder` as plain transformers loads it (its own sdpa attention, no
    packing), with the same config overrides as the trainer; eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.rope import apply_config_overrides

    config = AutoConfig.from_pretrained(folder)
    if overrides:
        apply_config_overrides(config, overrides)
    config.use_cache = False
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, dtype=dtype,
                                                 attn_implementation="sdpa")
    return model.to(device).eval()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --- trajectories -------------------------------------------------------------------------

def random_trajectories(lengths: Sequence[int], vocab: int, seed: int = 0,
                        tool_segments: bool = True) -> list[Trajectory]:
    """Sequences of the given total lengths: a prompt of 1/8, then model turns with a
    tool output (mask 0) between them, as an agent trajectory holds. Behaviour logprobs are
    placeholders (0): the checks that train fill them in (`with_behaviour`)."""
    rng = np.random.default_rng(seed)
    trajs = []
    for i, n in enumerate(lengths):
        p = max(2, n // 8)
        r = n - p
        mask = np.ones(r, np.int8)
        if tool_segments and r >= 16:
            for start in range(r // 4, r - 4, max(r // 3, 4)):  # two or three tool outputs
                mask[start:start + max(2, r // 16)] = 0
        trajs.append(Trajectory(task_id=f"t{i}", group_id="g", index=i,
                                prompt_ids=rng.integers(0, vocab, p), response_ids=rng.integers(0, vocab, r),
                                response_mask=mask, logprobs=np.zeros(r, np.float32),
                                versions=np.where(mask == 1, 0, -1), termination="finished"))
    return trajs


def with_behaviour(traj: Trajectory, logprobs_R: np.ndarray) -> Trajectory:
    """`traj` with `logprobs_R` (one per response token) as its behaviour logprobs on
    model tokens, 0 elsewhere (the engine's convention)."""
    return dataclasses.replace(traj, logprobs=np.where(traj.response_mask == 1, logprobs_R,
                                                       0.0).astype(np.float32))


@torch.no_grad()
def compute_reference_logprobs(model: torch.nn.Module, traj: Trajectory,
                               chunk_tokens: int = 4096) -> np.ndarray:
    """log p(response token j | everything before it) for every response token, from one
    unpacked Hugging Face forward of prompt + response (fp32 log-softmax of the model's own
    logits). The LM head runs `chunk_tokens` positions at a time: 32k positions of a
    151,936-entry vocabulary are 20 GB of fp32 logits at once."""
    device = next(model.parameters()).device
    ids_T = torch.from_numpy(traj.input_ids().astype(np.int64)).to(device)
    hidden_TH = model.get_decoder()(input_ids=ids_T[None], use_cache=False).last_hidden_state[0]
    head = model.get_output_embeddings()
    first, last = len(traj.prompt_ids) - 1, len(ids_T) - 1  # position t predicts token t + 1
    out = []
    for a in range(first, last, chunk_tokens):
        b = min(a + chunk_tokens, last)
        logits_CV = head(hidden_TH[a:b]).float()
        out.append(torch.log_softmax(logits_CV, -1).gather(-1, ids_T[a + 1:b + 1, None])[:, 0])
    return torch.cat(out).cpu().numpy()


# --- memory --------------------------------------------------------------------------------

def _proc_status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def cpu_peak_supported() -> bool:
    """Linux lets a process reset its peak resident set (VmHWM) through clear_refs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        _proc_status_bytes("VmHWM")
        return True
    except (OSError, KeyError):
        return False


def measure_peak(run: Callable[[], Any], device: str) -> tuple[Any, dict[str, float]]:
    """`run()` and its memory: `base` (bytes in use before) and `peak` (bytes at the high
    point). On cuda the caching allocator's own counts of tensor bytes; on cpu the process's
    resident set (VmHWM, reset before), which also counts the allocator's and the
    interpreter's pages: coarse, good for gigabyte differences only."""
    free_memory()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = run()
        torch.cuda.synchronize()
        return out, {"base": float(base), "peak": float(torch.cuda.max_memory_allocated())}
    if not cpu_peak_supported():
        return run(), {}
    base = _proc_status_bytes("VmRSS")
    out = run()
    return out, {"base": float(base), "peak": float(_proc_status_bytes("VmHWM"))}


def gib(num_bytes: float) -> float:
    return num_bytes / 2**30
