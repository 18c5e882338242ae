"""Export a training checkpoint as a Hugging Face model folder that transformers and vLLM
load: weights as safetensors (sharded above `--max-shard-size`), config, generation
config, tokenizer and chat template.

    python -m trainer.export RUN_DIR/checkpoints/step-000040 OUT [--dtype bfloat16] [--model DIR]

Weights come from the checkpoint's backend state: the torch backend's state dict, or the
DeepSpeed checkpoint (ZeRO 1-3 gathered to full fp32 weights with DeepSpeed's own
zero_to_fp32; stage 0 reads the module weights). Config and tokenizer come from, in order:
`--model DIR`, the checkpoint's `model/` folder (trainer.run.checkpoint keeps one), or the
run's `config.yaml` (`model.path`, when no warm start replaced it). The exported dtype is
the source config's unless `--dtype` says otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.run.checkpoint import MODEL_FILES, copy_model_files

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

DS_TAG = "state"  # the tag DeepSpeedBackend.save_state writes under
DTYPES = ("float32", "bfloat16", "float16")


def find_model_files(checkpoint: Path, model: str | None = None) -> Path:
    """The folder that holds the policy's config and tokenizer (see the module docstring)."""
    if model is not None:
        folder = Path(model).expanduser()
        if not (folder / "config.json").is_file():
            raise ValueError(f"--model {model}: no config.json there; give the Hugging Face "
                             "folder the run trained from")
        return folder
    if (checkpoint / MODEL_FILES / "config.json").is_file():
        return checkpoint / MODEL_FILES
    run_config = checkpoint.parent.parent / "config.yaml"
    if run_config.is_file():
        import yaml

        model_cfg = (yaml.safe_load(run_config.read_text()) or {}).get("model", {})
        if model_cfg.get("warm_start"):
            raise ValueError(f"{checkpoint} keeps no model files and its run warm-started "
                             f"from {model_cfg.get('path')!r} ({model_cfg['warm_start']}); pass "
                             "--model with the warm-started folder (its config and tokenizer)")
        from trainer.run.local_models import local_model_folder

        if (local := local_model_folder(str(model_cfg.get("path", "")))) is not None:
            return local
        if model_cfg.get("path") and (Path(model_cfg["path"]) / "config.json").is_file():
            return Path(model_cfg["path"])
    raise ValueError(f"{checkpoint} keeps no model files ({MODEL_FILES}/) and no run "
                     f"config.yaml names an existing model folder; pass --model with the "
                     "Hugging Face folder the run trained from")


def load_checkpoint_weights(checkpoint: Path) -> dict[str, "torch.Tensor"]:
    """Full weights under Hugging Face names from a checkpoint's backend state."""
    import torch

    backend = checkpoint / "backend"
    if (backend / "torch_state.pt").is_file():
        state = torch.load(backend / "torch_state.pt", map_location="cpu", weights_only=True)
        return dict(state["model"])
    tag = backend / DS_TAG
    if not tag.is_dir():
        raise ValueError(f"{backend} holds neither torch_state.pt nor a DeepSpeed checkpoint "
                         f"(tag {DS_TAG!r})")
    if any(tag.glob("zero_pp_rank_*_optim_states.pt")):  # written by ZeRO stages 1-3
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state = get_fp32_state_dict_from_zero_checkpoint(str(backend), tag=DS_TAG)
        if state is None:
            raise ValueError(f"{tag}: DeepSpeed read no weights from this ZeRO checkpoint; "
                             "give a checkpoint the run finished writing")
        return dict(state)
    files = sorted(tag.glob("mp_rank_*_model_states.pt"))
    if len(files) != 1:
        raise ValueError(f"{tag}: expected one mp_rank_*_model_states.pt, found {len(files)} "
                         "(tensor-parallel training checkpoints are not supported)")
    return dict(torch.load(files[0], map_location="cpu", weights_only=False)["module"])


def export_checkpoint(checkpoint: str | Path, out: str | Path, *, model: str | None = None,
                      dtype: str | None = None, max_shard_size: str = "5GB") -> Path:
    """Write `checkpoint` as a Hugging Face folder at `out` (created; must not exist)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint, out = Path(checkpoint).resolve(), Path(out)
    if out.exists():
        raise ValueError(f"{out} exists; export into a new folder")
    if not (checkpoint / "run_state.pkl").is_file() or not (checkpoint / "backend").is_dir():
        raise ValueError(f"{checkpoint} is not a complete sluice checkpoint (backend/ and "
                         "run_state.pkl); give a RUN_DIR/checkpoints/step-N folder")
    files = find_model_files(checkpoint, model)
    config = AutoConfig.from_pretrained(files)
    name = dtype or str(config.dtype or "float32").removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    weights = load_checkpoint_weights(checkpoint)
    with torch.device("meta"):  # no second copy of the weights: they are assigned below
        hf_model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, name))
    expected = set(hf_model.state_dict())
    missing, unexpected = expected - set(weights), set(weights) - expected
    if unexpected or (missing - _tied_keys(hf_model)):
        raise ValueError(f"{checkpoint}: its weights do not fit {files / 'config.json'} "
                         f"(missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}); "
                         "pass --model with the folder the run trained from")
    hf_model.load_state_dict({k: v.to(getattr(torch, name)) for k, v in weights.items()},
                             strict=False, assign=True)
    hf_model.tie_weights()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        hf_model.save_pretrained(tmp, safe_serialization=True, max_shard_size=max_shard_size)
        # Tokenizer, chat template and generation config as they are (save_pretrained
        # wrote config.json, with the export's dtype).
        copy_model_files(files, tmp, skip=("config.json", "sluice_build.json"))
        _record_origin(tmp, checkpoint, name)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _tied_keys(model: PreTrainedModel) -> set[str]:
    """State-dict names that tie_weights() fills from another (e.g. an lm_head tied to the
    embeddings), so a checkpoint may lack them."""
    if not model.config.tie_word_embeddings:
        return set()
    out = model.get_output_embeddings()
    names = {n for n, p in model.named_parameters(remove_duplicate=False) if out is not None
             and p is out.weight}
    return names or {"lm_head.weight"}


def _record_origin(folder: Path, checkpoint: Path, dtype: str) -> None:
    """A note of where the weights came from, next to them (not read by any loader)."""
    (folder / "sluice_export.json").write_text(json.dumps(
        {"checkpoint": str(checkpoint), "dtype": dtype}, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.export",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="RUN_DIR/checkpoints/step-N")
    parser.add_argument("out", help="the Hugging Face folder to write (must not exist)")
    parser.add_argument("--dtype", choices=DTYPES, help="weights dtype (default: the config's)")
    parser.add_argument("--model", help="folder with the config and tokenizer the run used "
                        "(default: the checkpoint's model/, then the run's config.yaml)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        out = export_checkpoint(args.checkpoint, args.out, model=args.model, dtype=args.dtype,
                                max_shard_size=args.max_shard_size)
    except ValueError as exc:
        print(f"export error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {args.checkpoint} -> {out}\n  transformers: "
          f"AutoModelForCausalLM.from_pretrained({str(out)!r})\n  vLLM:         "
          f"vllm.LLM(model={str(out)!r}), or serve it: python -m "
          f"vllm.entrypoints.openai.api_server --model {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
