"""The one error an invalid AtomDeployment spec raises, naming the field."""

from __future__ import annotations


class SpecError(ValueError):
    """An invalid AtomDeployment spec; `field` is the dotted path of the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
