"""Envs: the bottom of the stack, what agents act on and what every package shares.

The shared data (`types`: Task, Trajectory, Group, WorkspaceChanges), the schema helpers
(`knobs`) and the plug-in resolver (`plugins`), which import nothing else of the project;
then sandboxes (`sandbox/`: the Sandbox protocol and its backends), the sandbox pool of
one sandbox worker (`pool`, Ray shell `pool_actor`), the per-trajectory environment that
owns a trajectory's tools and sandbox lease (`trajectory_env`), the tools (`tools/`), the
task formats and bundled task sets (`tasks/`), and the host's cache folder and stale-state
reaper. Its recipe section is `envs.*` (`envs.config`).
"""
