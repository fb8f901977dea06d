"""What a checkpoint that cannot be loaded raises: the bottom of engine/loading/, imported by
the readers and builders above it and by nothing it imports (it imports nothing)."""
from __future__ import annotations


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file and the problem."""


def check_keys(keys, expected, where: str, context: str, optional=()) -> None:
    """Raise CheckpointError naming unknown and missing state-dict keys (at most 8 of each).

    keys: the checkpoint's keys; expected: the keys the architecture needs; optional: keys
    it accepts but does not need. `where` names the file, `context` the expected model.
    """
    keys = set(keys)
    unknown = sorted(keys - set(expected) - set(optional))
    missing = sorted(set(expected) - keys)
    if unknown or missing:
        show = lambda ks: f"{ks[:8]}{' ...' if len(ks) > 8 else ''}"
        parts = ([f"missing keys {show(missing)}"] if missing else []) + \
                ([f"unknown keys {show(unknown)}"] if unknown else [])
        raise CheckpointError(f"{where}: {'; '.join(parts)} {context}")
