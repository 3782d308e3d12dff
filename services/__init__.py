"""squall: reinforcement-learning training for any LLM agent, as services on Redis Streams.

Import names: the folder `services/` is the package `squall` (services/runner is
`squall.runner`, ...) and the folder `shared/` is `squall.shared`; see README "Layout".
"""

__version__ = "0.1.0"
