"""`price`: the shop's price list as a tool, looked up in process (no sandbox).

A tool is a class built once per trajectory as `PriceTool(env)`; `env` is that
trajectory's environment (its task, and its sandbox when a tool of the trajectory sets
`needs_sandbox = True`). The model sees `schema`; `execute` gets the parsed arguments,
already checked against the schema, and returns the observation as a ToolResult.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rollout.api import JsonObject, ToolResult, function_schema

if TYPE_CHECKING:
    from rollout.api import TrajectoryEnv

# Price of one item, in coins. tasks.jsonl's answers are computed from this table.
PRICES = {"apple": 3, "pear": 5, "lemon": 2, "melon": 12, "plum": 4, "mango": 7}


class PriceTool:
    name = "price"
    schema = function_schema("price", "The price of one item in the shop, in coins.",
                             {"item": {"type": "string", "description": "e.g. apple"}},
                             required=("item",))

    def __init__(self, env: TrajectoryEnv) -> None:
        self.task_id = env.task.id  # unused here; a tool may read its trajectory's task

    async def execute(self, arguments: JsonObject) -> ToolResult:
        item = str(arguments["item"]).strip().lower().removesuffix("s")
        if item not in PRICES:
            # An expected failure is a result the model can act on, not an exception.
            return ToolResult(f"No item {arguments['item']!r}; the shop sells "
                              f"{', '.join(sorted(PRICES))}.", is_error=True)
        return ToolResult(f"{item}: {PRICES[item]} coins")
