"""Buffer: what lies between the rollout side and training, as plain Python.

The staleness-bounded `replay_buffer` (admission while fewer than (eta + 1) x B groups are
alive, eviction of groups older than eta versions, exact accounting of every admitted
group), the `batch` a training step takes (a TrainBatch of trajectories and their GRPO
advantages), and the circuit `breaker` that stops a run whose groups fail the same way
again and again. Its recipe section is `buffer.*` (`buffer.config`).
"""
