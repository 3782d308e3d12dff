"""One flat hierarchy of squall's errors.

Catch only where you retry, requeue or dead-letter; everything else propagates.
Every message says what was wrong and, where it helps, what to do about it.
"""


class SquallError(Exception):
    """Base of every error squall raises on purpose."""


class ConfigError(SquallError):
    """A config file or environment override is invalid; the message names the field."""


class SchemaError(SquallError):
    """A wire message could not be decoded or failed validation; the entry is dead-lettered."""


class RedisUnavailable(SquallError):
    """No Redis answers at the configured URL and none could be started."""


class DeadlineExceeded(SquallError):
    """A bounded wait ran past its deadline."""


class WeightsError(SquallError):
    """A published weight file is missing, corrupt or does not match its checksum."""


class AgentError(SquallError):
    """The user's agent failed: raised, returned no usable reward, or broke the contract."""


class ToolError(SquallError):
    """A tool call of the pool (services/toolpool) failed: bad arguments, an unknown tool, the
    job failed, hit a limit or missed the caller's deadline. The message is what an agent
    shows its model, as it would any tool error."""


class RunNotFound(SquallError):
    """A command that reads a run found none of its keys in any Redis it looked in; the message
    names the run, each Redis and the runs it holds, and how to point the command elsewhere."""
