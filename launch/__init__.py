"""Launch tooling: the tiny local model, multi-node launch helpers."""
