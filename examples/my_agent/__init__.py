"""An example of a user package for sluice (docs/custom_agent.md walks through it): an
agent loop, a reward function, a tool and a task file, wired by `recipe.yaml`.

    python -m trainer.main recipe=examples/my_agent/recipe.yaml --dry-run   # check it
    python -m trainer.main recipe=examples/my_agent/recipe.yaml             # train

Run from the folder that holds `examples/` (or put that folder on PYTHONPATH): the import
strings `examples.my_agent.<module>:<Class>` must resolve in every Ray worker.
"""
