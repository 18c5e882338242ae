"""Trainer: config schema, recipes, pools, controller, loss, backends, weight sync."""
