"""The plan's problems: every message collected once, in order, and how a message shows a value
(and reads a YAML or -e boolean)."""
from __future__ import annotations

import re


class Problems:
    """Error messages, in order, each once; and notes: what the plan saw and worked around, said
    to the operator while the playbook goes on."""

    def __init__(self):
        self.messages = []
        self.notes = []

    def add(self, message):
        if message not in self.messages:
            self.messages.append(message)

    def note(self, message):
        if message not in self.notes:
            self.notes.append(message)


def shown(value):
    """A value as a message shows it: numbers plain (-e gives them as strings), the rest quoted."""
    return str(int(value)) if is_int(value) else repr(value)


def is_int(value):
    """A whole number, or its decimal digits alone (-e gives numbers as strings): nothing around
    them, no other digits than 0-9."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value) is not None)


def as_bool(value):
    """A YAML/-e boolean (true, "yes", "1", ...) as bool."""
    if isinstance(value, bool):
        return value
    return str(value).strip().lower() in ("1", "true", "yes", "on")
