"""Simulated parts of `launch.simulate`: an engine with a KV pool and an LRU prefix cache, a
sandbox pool with heavy-tailed execution times and queueing, and a trainer whose step and
weight-push times follow the planner's formulas. They are plain, clock-free classes: the
caller passes the time, so they run the same under a virtual clock and in unit tests."""
