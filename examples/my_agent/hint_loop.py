"""`HintLoop`: an agent loop written from scratch, not derived from a built-in one. The
model answers; a wrong answer gets one hint from the user and a second try.

It uses only what the worker hands every loop (docs/custom_agent.md, "A loop from scratch",
shows this file): the continuity builder `ctx.chat` for every id it appends, `ctx.generate`
for the model's turns, the family's parsers (`parse_generation`) to read them, and the
recorder that `ctx.start` returns. The hint is context, not a model turn: it is recorded
with mask 0 and only the answers are trained. No tools: try it with
`agent.loop=examples.my_agent.hint_loop:HintLoop envs.tasks=toy_arithmetic_easy`.
"""

from __future__ import annotations

from rollout.api import (AgentContext, Message, Task, TerminationReason, Trajectory,
                         extract_final_answer, parse_generation)

HINT = "That is not right. Check each step, then reply with 'Answer: <value>'."


def is_right(text: str, task: Task) -> bool:
    """Whether the final answer in `text` (read as reward.rules reads it) is the task's."""
    answer = extract_final_answer(text)
    return answer is not None and task.answer is not None and answer == task.answer.strip()


class HintLoop:
    max_hints = 1  # a class constant; per-trajectory state lives in locals and on ctx

    async def run(self, task: Task, ctx: AgentContext) -> Trajectory:
        rec = ctx.start(ctx.chat.initial_prompt_ids(task.messages, None))  # no tools offered
        for hints in range(self.max_hints + 1):
            if (stop := rec.generation_stop()) is not None:
                return rec.finish(stop)  # context_full or max_tokens: no room for a turn
            out = await ctx.generate()  # appends the sampled ids (mask 1) and their logprobs
            if out.finish_reason == "abort":
                return rec.finish(TerminationReason.ERROR, "generation was aborted")
            if out.finish_reason == "length":  # cut by max_new_tokens_per_turn or a budget
                return rec.finish(TerminationReason.MAX_TOKENS)
            # The family's vLLM parsers split reasoning from the answer, as a server would;
            # prompt_ids are the ids this turn was generated from.
            parsed = parse_generation(ctx.chat, ctx.tokenizer, out.token_ids, tools=None, max_calls=0,
                                      prompt_ids=rec.context_ids[:rec.sent_prefix_lengths[-1]])
            rec.record_tool_parse(parsed.status)  # "no_call": counted in rollout/tool_parse/*
            if hints == self.max_hints or is_right(parsed.content, task):
                break
            # The user's hint in the template's own glue after this turn (never re-tokenize
            # what the model wrote), appended with mask 0 like a tool result.
            hint_ids = ctx.chat.user_message_ids([Message("user", HINT)], ctx.ended_with_stop(out))
            if (stop := rec.fits_observation(len(hint_ids))) is not None:
                return rec.finish(stop, "the hint does not fit")
            rec.add_observation(hint_ids, num_tool_calls=0, num_tool_errors=0, tool_s=0.0)
        return rec.finish(TerminationReason.FINISHED)
