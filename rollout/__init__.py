"""Rollout: everything that turns tasks into scored groups on the CPU and rollout-GPU side.

The vLLM engines behind a token-in/token-out interface (`engine`, Ray shell `engine_actor`)
and the sticky, load-aware `router` in front of them; the `gate` that holds turns while
weights are pushed; the `AgentLoop` API with its built-ins (`agent_loop`, `AGENT_LOOPS`),
the trajectory `recorder` and the per-family token-continuity builders (`chat`), with the
tool-call and reasoning parsers (`parsers`, `tool_parser`) and the start-up template
self-check (`template_check`); the `AgentLoopWorker` (`worker`, Ray shell
`worker_actor`) that runs a group's trajectories and scores them beside its sandbox pool
(reward.loop); the OpenAI / Anthropic gateway for black-box harnesses (`gateway/`); the
judge-engine client and the engines' weight-reload extension. Its recipe sections are
`rollout.*` and `agent.*` (`rollout.config`).
"""
