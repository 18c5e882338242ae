"""Entry point: `python -m trainer.main recipe=NAME.yaml [section.key=value ...] [--dry-run]`.

Reads the recipe, checks it against the schema before anything heavy starts, prints the
resolved config and the resource-pool plan, validates what it names (trainer.run.validate:
plug-ins, task rows, tools, model; every problem listed, exit 2), then (without
--dry-run) builds the system and trains (trainer.run.system, trainer.run.controller).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import traceback
from pathlib import Path

from envs.knobs import field_default
from rollout.engine import quiet_vllm_cpu_notice
from trainer.run.config import SluiceConfig, iter_fields
from trainer.run.model_check import check_models, format_model_report
from trainer.run.pools import format_pool_plan, plan_pools
from trainer.run.sizing import resolve_agent_workers
from trainer.run.recipe import load_config

# Exit codes (docs/troubleshooting.md has the table).
EXIT_DONE = 0  # trained train.num_steps, or --dry-run found nothing wrong
EXIT_ERROR = 1  # an unexpected error: a bug in sluice or a plug-in (traceback printed)
EXIT_CONFIG = 2  # the recipe or what it names: nothing started, or starting found it
EXIT_BREAKER = 3  # the circuit breaker: one failure repeated group after group
EXIT_STARTUP = 4  # a part of the system did not start (Ray, a pool, an engine)
EXIT_STOPPED = 130  # Ctrl-C or SIGTERM, before the start (nothing to resume) or after it
STOPPED_BEFORE_START = "stopped before the run started; nothing to resume"

USAGE = """usage: python -m trainer.main recipe=NAME.yaml [section.key=value ...] [--dry-run]

  recipe=NAME.yaml   a file in recipes/ or a path to one
  section.key=value  override any key below (OmegaConf dotlist syntax)
  --dry-run          print the resolved config and the pool plan, check everything the
                     recipe names (as a run does), then exit: 0 ready, 2 problems
  -h, --help         this text and every config key
"""


def format_help() -> str:
    lines = [USAGE, "config keys (default; doc):"]
    for key, f in iter_fields(SluiceConfig):
        default = field_default(f)
        lines.append(f"  {key} = {default!r}  [{f.type}]\n      {f.metadata['doc']}")
    return "\n".join(lines)


def format_config(cfg: SluiceConfig) -> str:
    import yaml  # deferred: only printing needs it

    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False, default_flow_style=False)


def parse_argv(argv: list[str]) -> tuple[str | None, list[str], bool, bool]:
    """Split argv into (recipe, overrides, dry_run, help); unknown flags are errors."""
    recipe, overrides, dry_run, want_help = None, [], False, False
    for arg in argv:
        if arg in ("-h", "--help"):
            want_help = True
        elif arg == "--dry-run":
            dry_run = True
        elif arg.startswith("-"):
            raise ValueError(f"unknown flag {arg!r}; flags are --dry-run and --help")
        elif arg.startswith("recipe="):
            recipe = arg.removeprefix("recipe=")
        else:
            overrides.append(arg)
    return recipe, overrides, dry_run, want_help


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    quiet_vllm_cpu_notice()
    try:
        recipe, overrides, dry_run, want_help = parse_argv(sys.argv[1:] if argv is None else argv)
        if want_help:
            print(format_help())
            return EXIT_DONE
        cfg = load_config(recipe, overrides)
        if not cfg.model.path:
            raise ValueError("model.path is required: a Hugging Face model folder, or 'tiny' "
                             "for the local test model")
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG

    from trainer.run.validate import format_problems, validate_run

    # Checks first, so an error comes within seconds and before any report: plug-ins, task
    # rows, tools, the model folder, then the chat template (vLLM's parsers) once those pass.
    try:
        models = check_models(cfg)  # context vs positions, TP vs heads, memory per rank and engine
        problems = (models.problems + validate_run(cfg, build_task_sets=not dry_run)
                    + _resume_problems(cfg, recipe))
    except KeyboardInterrupt:  # builds under way clean up after themselves (envs.cache)
        print(f"\n{STOPPED_BEFORE_START}", file=sys.stderr)
        return EXIT_STOPPED
    if problems:
        print(f"config error: {format_problems(problems)}", file=sys.stderr, flush=True)
    elif dry_run:
        print(format_config(cfg))
    else:  # ~150 lines: a run writes it to its folder instead
        print(f"config: {recipe or 'defaults'} with {len(overrides)} override(s); the resolved "
              "config goes to the run folder's config.yaml (`--dry-run` prints it)")
    print("resource pools:\n" + format_pool_plan(plan_pools(cfg)))
    print(f"agent-loop workers: {resolve_agent_workers(cfg).describe()}")
    print(format_model_report(models))
    if problems:
        return EXIT_CONFIG
    if dry_run:
        return EXIT_DONE

    import asyncio

    from trainer.run.controller import RepeatedFailureError
    from trainer.run.pools import StartupError
    from trainer.run.system import run  # Ray, vLLM, DeepSpeed from here on

    try:
        summary, run_dir = asyncio.run(run(cfg, Path(recipe or "run").stem))
    except RepeatedFailureError as exc:
        print(f"\n{exc}", file=sys.stderr)
        return EXIT_BREAKER
    except ValueError as exc:  # found while starting (a task file, a model folder)
        print(f"config error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except StartupError as exc:
        print(f"\nstart-up failed: {exc}\nNothing was trained; the log above has the details.",
              file=sys.stderr)
        return EXIT_STARTUP
    except (KeyboardInterrupt, asyncio.CancelledError):
        print(f"\n{STOPPED_BEFORE_START}", file=sys.stderr)
        return EXIT_STOPPED
    except Exception:  # a bug (in sluice or a plug-in): the traceback says where
        traceback.print_exc()
        print("\nerror: the run failed unexpectedly (traceback above); its folder and "
              "checkpoints, if any, are kept. Please report it with the traceback.", file=sys.stderr)
        return EXIT_ERROR
    if summary.stopped_early:  # Ctrl-C or SIGTERM: the resume command is printed above
        return EXIT_STOPPED
    first, last = _mean_head_tail(summary.rewards_per_step)
    print(f"\ndone: {summary.steps} steps in {summary.seconds:.0f}s; mean reward first steps "
          f"{first:.3f}, last steps {last:.3f}; groups admitted {summary.admitted}, trained "
          f"{summary.trained}, dropped {summary.dropped}, in flight at the end {summary.running}, "
          f"buffered at the end {summary.buffered}")
    if summary.eval_rewards:
        evals = ", ".join(f"version {v}: {r:.3f}" for v, r in sorted(summary.eval_rewards.items()))
        print(f"held-out mean reward ({cfg.eval.tasks}): {evals}")
    print(f"run folder:  {run_dir}\nmetrics:     {run_dir / 'metrics.jsonl'}\n"
          f"transcripts: {run_dir / 'transcripts.jsonl'}\nwandb:       {run_dir / 'wandb'} "
          f"(offline runs: `wandb sync {run_dir / 'wandb'}/offline-run-*`)")
    return EXIT_DONE


def _resume_problems(cfg: SluiceConfig, recipe: str | None) -> list[str]:
    """checkpoint.resume_from found as the run will look for it (a run folder, a checkpoint,
    or `latest` of this recipe's runs)."""
    if cfg.checkpoint.resume_from is None:
        return []
    from trainer.run.system import resolve_run_place

    try:
        resolve_run_place(cfg, Path(recipe or "run").stem)
    except ValueError as exc:
        return [str(exc)]
    return []


def _mean_head_tail(values: tuple[float, ...], k: int = 5) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    k = max(1, min(k, len(values) // 2 or 1))
    return sum(values[:k]) / k, sum(values[-k:]) / k


if __name__ == "__main__":
    sys.exit(main())
