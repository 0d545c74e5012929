"""The project's own exception types; the CLI prints them without a traceback."""


class OffloadError(Exception):
    """Base class: a user-facing error whose message says what was wrong and what to do."""


class ConfigError(OffloadError):
    """A model config, YAML config or CLI flag is missing, malformed or unsupported."""


class WeightsError(OffloadError):
    """A checkpoint file is missing, truncated, mis-shaped or not what it claims to be."""


class SamplingError(OffloadError):
    """A sampling parameter is out of range; param names its SamplingParams field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PlanError(OffloadError):
    """No placement fits the budget; the message says what is short and by how much."""


class KernelError(OffloadError):
    """A kernel was given an input it cannot take (shape, dtype, layout)."""


class DeviceMemoryError(OffloadError):
    """A device (or simulated device) has no room for an allocation the plan did not foresee."""


class OutputError(OffloadError):
    """A job's outputs cannot be written (disk full, permissions); what was written before is kept. reason: the
    system's word for it (strerror), for a caller that words its own message."""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        self.reason = reason


class BudgetError(OffloadError):
    """Memory measured while running passed the budget, and the job asked to stop then."""


class CalibrationError(OffloadError):
    """Measurements of this machine contradict each other (its speed moved while they ran); nothing was saved."""


class QueueFull(OffloadError):
    """The engine's waiting queue is at its bound; the request may be sent again later (a server answers 503)."""


class ToolError(ConfigError):
    """A chat request's tools, tool_choice or tool messages cannot run; param names the body field at fault."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
