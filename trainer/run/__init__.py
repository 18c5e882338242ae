"""The run: the composition root and everything the driver runs.

`system` builds a run from the composed config (`config`, `recipe`; checked before start
by `validate` and `model_check`) on the resource pools (`pools`), then `controller` drives
it against its two seams (`seams`: the rollout side and the train side); `metrics`,
`checkpoint` and `export` record, save and hand out what it made. It reaches the train
side only through that side's entry points (tests/unit/test_layering.py).
"""
