"""The one error type that model loading raises, so notebooks can catch it."""


class ModelNotAvailableError(RuntimeError):
    """A model cannot be loaded here (not available offline, not installed, or unknown)."""
