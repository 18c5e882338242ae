"""`python -m launch.quickstart model` prints the folder of the quickstart's warm-started
tiny model (the cached one; the first test that needs it builds it, about two minutes),
the same folder the quickstart run trains from, and that model calls the `python` tool
when asked a toy question, as gateway experiments need."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from envs.tasks.toy import build_toy_arithmetic_easy

ROOT = Path(__file__).resolve().parents[2]


def test_it_prints_the_warm_started_model_that_calls_tools() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.run.recipe import load_config
    from trainer.run.system import resolve_model

    proc = subprocess.run([sys.executable, "-m", "launch.quickstart", "model"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr
    [line] = proc.stdout.splitlines()  # only the folder on stdout: $(...) in a shell
    folder = Path(line)
    assert folder == Path(resolve_model(load_config("quickstart.yaml")))  # the quickstart's
    assert folder.name.startswith("warm-")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in folder.iterdir()}

    # It calls the tool: a held-out-style question, greedy, as the warm start taught it.
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    task = build_toy_arithmetic_easy(1, seed=7)[0]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": task.messages[-1].content}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    out = model.generate(**prompt, max_new_tokens=48, do_sample=False)
    reply = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:])
    assert '<tool_call>' in reply and '"python"' in reply, reply
