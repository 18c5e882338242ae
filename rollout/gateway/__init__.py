"""The gateway: OpenAI / Anthropic endpoints per session in front of the sticky router, so
black-box harnesses that never hand over token ids are trained with exact tokens.

- server: sessions, segments (one per history rewrite), the HTTP app;
- protocol: the two wire formats <-> one model turn (plain functions, every field type-checked);
- refusals: the error shape, the reasons gateway/errors counts, and the cheap checks every
  body passes first (size, UTF-8, nesting depth, lone surrogates);
- procs: several gateway processes behind the worker's one router and turn gate;
- journal: each session's changes to its segments appended to a file, from which the worker
  rebuilds the sessions of a gateway process that died;
- loop: GatewayAgentLoop, the AgentLoop that runs a harness against its own session;
- mini_swe: mini-swe-agent trained through it.
"""
