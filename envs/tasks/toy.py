"""`toy_arithmetic`: the quickstart's tool-use task set. Each task is an integer arithmetic
expression too long to do reliably in one's head; the agent is meant to evaluate it with
the `calculator` or `python` tool and reply with the number, which `reward.rules:
ExactMatch` checks against the exact value.

Generated deterministically from a seed (its own `random.Random`, never the global one),
so a recipe names the set and every worker builds the same tasks.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Set

from envs.tools.calculator import evaluate_arithmetic
from envs.types import Message, Task

SET_NAME = "toy_arithmetic"
# Two operands below 100, python tool only: what the quickstart's 0.5M-parameter model can
# learn to solve on a CPU in minutes (it must copy the expression into a tool call).
EASY_SET_NAME = "toy_arithmetic_easy"
DEFAULT_NUM_TASKS = 256
DEFAULT_SEED = 0
# `<set>_heldout`: the same distribution from another seed, minus every expression of the
# default set, for evaluation (eval.tasks).
HELDOUT_SUFFIX = "_heldout"
HELDOUT_SEED = 1
TOOLS = ("calculator", "python")
SYSTEM_PROMPT = ("You are a careful assistant with tools. Use the calculator or python tool "
                 "for arithmetic instead of computing in your head.")
PROMPT = "What is {expression}? Reply with the final answer as 'Answer: <integer>'."


def _operand(rng: random.Random) -> str:
    value = rng.randint(2, 999)
    return f"({value - rng.randint(1, 60)} + {rng.randint(1, 60)})" if rng.random() < 0.15 \
        else str(value)


def make_expression(rng: random.Random) -> tuple[str, int]:
    """An expression of 3-5 operands with + - * and one pair of parentheses, and its value."""
    num_operands = rng.randint(3, 5)
    terms = [_operand(rng) for _ in range(num_operands)]
    ops = [rng.choice(("+", "-", "*")) for _ in range(num_operands - 1)]
    start = rng.randrange(num_operands - 1)
    terms[start] = "(" + terms[start]
    terms[start + 1] = terms[start + 1] + ")"
    text = terms[0] + "".join(f" {op} {term}" for op, term in zip(ops, terms[1:]))
    # The calculator tool's own evaluator: the answer is exactly what the tool would say.
    return text, int(evaluate_arithmetic(text))


def build_toy_arithmetic(num_tasks: int = DEFAULT_NUM_TASKS, seed: int = DEFAULT_SEED) -> list[Task]:
    """`num_tasks` tasks, the same ones for the same seed."""
    return _build_set(SET_NAME, *_SETS[SET_NAME], num_tasks, seed)

def make_easy_expression(rng: random.Random) -> tuple[str, int]:
    """`a op b` with a, b in [2, 99]."""
    text = f"{rng.randint(2, 99)} {rng.choice(('+', '-', '*'))} {rng.randint(2, 99)}"
    return text, int(evaluate_arithmetic(text))


def build_toy_arithmetic_easy(num_tasks: int = DEFAULT_NUM_TASKS, seed: int = DEFAULT_SEED
                              ) -> list[Task]:
    """The easy variant (see EASY_SET_NAME); same prompt format and reward as the full set."""
    return _build_set(EASY_SET_NAME, *_SETS[EASY_SET_NAME], num_tasks, seed)


def build_heldout(name: str, num_tasks: int = DEFAULT_NUM_TASKS) -> list[Task]:
    """`num_tasks` tasks of set `name` (SET_NAME or EASY_SET_NAME) that share no expression
    with the default training set of that name."""
    make, tools = _SETS[name]
    training = {t.messages[-1].text
                for t in _build_set(name, make, tools, DEFAULT_NUM_TASKS, DEFAULT_SEED)}
    return _build_set(name + HELDOUT_SUFFIX, make, tools, num_tasks, HELDOUT_SEED, training)


def _build_set(name: str, make: Callable[[random.Random], tuple[str, int]], tools: tuple[str, ...],
               num_tasks: int, seed: int, exclude: Set[str] = frozenset()) -> list[Task]:
    if num_tasks < 1:
        raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
    rng = random.Random(seed)
    tasks = []
    while len(tasks) < num_tasks:
        i = len(tasks)
        expression, value = make(rng)
        question = PROMPT.format(expression=expression)
        if question in exclude:
            continue
        messages = (Message("system", SYSTEM_PROMPT), Message("user", question))
        tasks.append(Task(id=f"{name}/{seed}/{i}", messages=messages, tools=tools,
                          answer=str(value), reward_fn="reward.rules:ExactMatch"))
    return tasks


# Set name -> (expression generator, tools offered).
_SETS = {SET_NAME: (make_expression, TOOLS), EASY_SET_NAME: (make_easy_expression, ("python",))}
