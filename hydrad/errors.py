"""Errors a user can cause; each reads as one clear line."""


class HydradError(Exception):
    """Base class for errors shown to the user as one line (no traceback)."""


class CheckpointError(HydradError, ValueError):
    """A model folder is missing files, or holds an architecture hydrad does not serve."""


class ConfigError(HydradError, ValueError):
    """A configuration file or flag holds an invalid value."""


class RequestError(HydradError, ValueError):
    """A request is malformed; ``param`` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code
