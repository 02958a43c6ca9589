"""User-facing errors.

A ``HetplanError`` is a mistake the user can fix: the CLI prints its message (what was wrong,
where, what to do) and exits non-zero, never with a traceback. Anything else is a bug.
"""


class HetplanError(Exception):
    """An error caused by the user's input, with a message that says how to fix it."""


class InfeasibleError(HetplanError):
    """No placement satisfies the memory constraints; the message says what is missing."""
