"""Simulated parts of `launch.simulate`: an engine with a KV pool and an LRU prefix cache
(`engine_model`, behind the router's client interface in `engine_client`), a sandbox pool
with heavy-tailed execution times and queueing (`sandbox_model`), a trainer whose step and
weight-push times follow the planner's formulas (`trainer_model`), the controller's two
seams built on them (`sides`), and the real AgentLoopWorker wired to them (`agent_side`).
The models are plain, clock-free classes: the caller passes the time, so they run the
same under a virtual clock and in unit tests."""
