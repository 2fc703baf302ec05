"""Domain errors. The CLI turns each into one clear line on stderr and exit code 1."""


class FlashError(Exception):
    """Base of every error flashllm reports to the user as one line."""


class SourceError(FlashError):
    """A checkpoint (safetensors folder or GGUF file) that cannot be read or is not supported."""


class FormatError(FlashError):
    """A converted flash model that is missing, truncated, corrupt or of another format version."""


class KernelError(FlashError):
    """The native kernel reported a failure (bad argument, I/O error, allocation failure)."""


class RegistryError(FlashError):
    """A models.toml entry that is missing or invalid, or a model that cannot be fetched."""
