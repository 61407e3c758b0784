"""ConfigError: a user error named by its field.  At the bottom of the package layers so that every layer
(file writes, the host, the configuration and above) raises the same error, which the CLI prints as one line
with exit code 2.  Pure Python."""
from __future__ import annotations


class ConfigError(ValueError):
    """A user error in a configuration: one line naming the field and what is allowed."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name  # the user-facing field (or option) the error is about
        self.message = message  # what is wrong and what is allowed, without the field
        super().__init__(field_name, message)

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"
