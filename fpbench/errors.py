"""The one exception type that means "the user asked for something impossible"."""


class FpbenchError(Exception):
    """A user-facing error: the CLI prints its message on one line and exits with code 2."""
