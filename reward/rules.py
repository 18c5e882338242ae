"""Rule verifiers: compare the final answer in the agent's last assistant text with
`Task.answer`.

`extract_final_answer` reads the last assistant text (RewardContext.final_text) with
`<think>...</think>` and `<tool_call>...</tool_call>` blocks removed, and takes the first
of these that is present:

1. the content of the LAST `\\boxed{...}` (nested braces allowed);
2. the rest of the line after the LAST "answer:", "answer is", "final answer:" or
   "answer =" (any case; if that rest is empty, the next non-empty line);
3. the LAST number in the text (123, -4.5, 1,234, 6.02e23).

Only one candidate is ever compared, so hedging ("Answer: 41 or 42", many boxed
answers, a list of numbers) earns nothing: in forms 1 and 2 the whole extracted text
must equal the answer, and in form 3 only the last number counts.
"""

from __future__ import annotations

import re
from fractions import Fraction

from reward.base import RewardContext, RewardResult
from envs.types import Task, Trajectory

_HIDDEN_BLOCKS = re.compile(r"<think>.*?(?:</think>|$)|<tool_call>.*?(?:</tool_call>|$)", re.S)
_ANSWER = re.compile(r"(?i)\b(?:final\s+answer|answer)\s*(?::|=|\bis\b)[ \t]*(.*)$", re.M)
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w])")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_STRIP = " \t\r\n*`$\"'"


def extract_final_answer(text: str) -> str | None:
    """The final answer in `text` (see the module docstring), or None."""
    text = _HIDDEN_BLOCKS.sub("", text)
    # Templates that open the thinking block themselves leave only its closing tag.
    text = text.rsplit("</think>", 1)[-1]
    boxed = _last_boxed(text)
    if boxed is not None:
        return _clean(boxed)
    matches = list(_ANSWER.finditer(text))
    if matches:
        last = matches[-1]
        rest = last.group(1)
        if not rest.strip(_STRIP):
            following = [line for line in text[last.end():].splitlines() if line.strip(_STRIP)]
            rest = following[0] if following else ""
        cleaned = _clean(rest)
        if cleaned:
            return cleaned
    numbers = _NUMBER.findall(text)
    return _clean(numbers[-1]) if numbers else None


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None  # unbalanced: no boxed answer


def _clean(answer: str) -> str:
    answer = answer.strip(_STRIP)
    while answer.endswith(".") and not answer.endswith(".."):
        answer = answer[:-1].rstrip(_STRIP)
    return answer.strip(_STRIP)


def parse_number(text: str) -> Fraction | None:
    """The exact value of an integer, decimal, scientific or a/b fraction; else None."""
    text = text.strip().lstrip("+")
    if _THOUSANDS.match(text):
        text = text.replace(",", "")
    # Exponents are capped: Fraction("1e99999999") would build a 100-million-digit int.
    if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?(?:/-?\d+)?", text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def _normalize_text(text: str) -> str:
    return " ".join(text.split()).casefold()


def _reference(task: Task) -> str:
    if task.answer is None:
        raise ValueError(f"task {task.id!r} has no answer; rule verifiers compare with "
                         "Task.answer, so set it (or use another reward fn)")
    return task.answer


class ExactMatch:
    """Reward 1.0 when the final answer equals `task.answer`: as numbers when both are
    numbers (so 1,000 == 1000 == 1000.0), else as text ignoring case and spacing."""

    async def __call__(self, trajectory: Trajectory, task: Task,
                       ctx: RewardContext) -> RewardResult:
        reference = _reference(task)
        answer = extract_final_answer(ctx.final_text)
        if answer is None:
            return RewardResult(0.0, {"correct": 0.0, "answer_found": 0.0}, "no final answer found")
        got, want = parse_number(answer), parse_number(reference)
        correct = got == want if got is not None and want is not None \
            else _normalize_text(answer) == _normalize_text(reference)
        return RewardResult(float(correct), {"correct": float(correct), "answer_found": 1.0},
                            f"answer {answer!r} vs reference {reference!r}")


class NumericMatch:
    """Reward 1.0 when the final answer is a number within tolerance of `task.answer`
    (|got - want| <= max(rel_tol * max(|got|, |want|), abs_tol), as math.isclose)."""

    def __init__(self, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> None:
        if rel_tol < 0 or abs_tol < 0:
            raise ValueError(f"NumericMatch tolerances must be >= 0, got {rel_tol}, {abs_tol}")
        self.rel_tol = rel_tol
        self.abs_tol = abs_tol

    async def __call__(self, trajectory: Trajectory, task: Task,
                       ctx: RewardContext) -> RewardResult:
        reference = _reference(task)
        want = parse_number(reference)
        if want is None:
            raise ValueError(f"task {task.id!r}: answer {reference!r} is not a number; "
                             "NumericMatch needs a numeric Task.answer (use ExactMatch)")
        answer = extract_final_answer(ctx.final_text)
        got = parse_number(answer) if answer is not None else None
        if got is None:
            return RewardResult(0.0, {"correct": 0.0, "answer_found": float(answer is not None)},
                                f"no numeric final answer (found {answer!r})")
        # Exact arithmetic: math.isclose's rule without float overflow on huge answers.
        tolerance = max(Fraction(self.rel_tol) * max(abs(got), abs(want)), Fraction(self.abs_tol))
        correct = abs(got - want) <= tolerance
        return RewardResult(float(correct), {"correct": float(correct), "answer_found": 1.0},
                            f"answer {answer!r} vs reference {reference!r}")
