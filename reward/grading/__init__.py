"""The trusted grading path of test-graded tasks: `HiddenTests` (hidden_tests) grades an
agent's final workspace in a fresh sandbox the agent never touched, and everything that
keeps that verdict out of the agent's reach lives beside it.

- host side: prepare (the grading folder), patch (the test patch, applied without the
  agent's files), runner_config (the grader's own pytest config), runtime (the bundled
  pytest), sentinels and mutation (tests that must fail: copies of real tests expecting
  changed values), import_graph (test helpers beside the code, protected like tests),
  crosscheck (stream vs report vs sentinels),
  swebench_log (repositories' own runners read by swebench's parsers), hacking (findings),
  validate (`python -m reward.validate`: rows through this path before training);
- sandbox side, standard library only, copied into each grading sandbox: driver, boot,
  recorder.
"""
