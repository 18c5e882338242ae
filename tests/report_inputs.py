"""Inputs of the run-report tests: the recorded run under tests/fixtures/report/ and a
simulator-style trace written here (virtual clock from 0, two engines, sandbox ids, tool
names and drop events: the optional fields of the event schema a real run does not
write yet)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

RECORDED_RUN = Path(__file__).resolve().parent / "fixtures" / "report" / "quickstart-20261201-095312"


def copy_recorded_run(into: Path) -> Path:
    """A writable copy of the recorded run folder (reports are written beside it)."""
    return Path(shutil.copytree(RECORDED_RUN, into / RECORDED_RUN.name))


def write_trace(path: Path, num_steps: int = 4, trajectories_per_step: int = 12,
                seed: int = 0) -> Path:
    """A trace in the events.jsonl schema: each step's trajectories start at the step's
    beginning on one of two engines, take 1-4 turns, and one group per step is dropped."""
    rng = random.Random(seed)
    rows: list[dict] = []
    clock = 0.0
    for step in range(1, num_steps + 1):
        step_t0 = clock
        for i in range(trajectories_per_step):
            t = step_t0 + rng.uniform(0.0, 1.0)
            turns = rng.randint(1, 4)
            for k in range(turns):
                generate_s = rng.uniform(0.2, 1.5)
                tool_s = rng.expovariate(1.0) if k < turns - 1 else 0.0
                row = {"kind": "turn", "step": step, "traj": f"g{step}{i // 4}/{i % 4}",
                       "task": f"swe-{i % 5}", "turn": k, "engine": f"engine-{i % 2}",
                       "version": max(step - 1 - (k == 0 and i % 3 == 0), 0), "t0": round(t, 4),
                       "queue_s": 0.05, "generate_s": round(generate_s, 4), "tool_s": round(tool_s, 4),
                       "tool_calls": int(tool_s > 0), "tool_errors": 0, "tokens": rng.randint(20, 400),
                       "sandbox": f"sb-{i % 6}", "tools": ["bash"] if k % 2 else ["python"]}
                if k == turns - 1:
                    row["end"] = "finished" if i % 5 else "max_turns"
                rows.append(row)
                t += 0.05 + generate_s + tool_s
            clock = max(clock, t)
        rows.append({"kind": "drop", "step": step, "group": f"g{step}x", "task": "swe-9",
                     "reason": "stale", "staleness": 2, "trajectories": 4, "turns": 4.0,
                     "tokens": 900.0})
        rows.append({"kind": "push", "step": step, "version": step, "t0": round(clock, 4),
                     "prepare_s": 0.5, "gates_closed_s": 0.2})
        clock += 0.7
        rows.append({"kind": "step", "step": step, "t0": round(step_t0, 4), "t1": round(clock, 4),
                     "trainer_wait_s": 0.8, "turns_dropped": 0})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
