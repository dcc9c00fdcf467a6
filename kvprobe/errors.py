"""One exception type for every user-facing failure, so the CLI can print a single clear line."""


class KVProbeError(Exception):
    """A problem the user can fix: the message names what is wrong and how to fix it."""
