"""What an export that cannot be made raises."""
from __future__ import annotations


class ExportError(ValueError):
    """Bad input to an export (an unknown format or dtype, a static length below a prompt, an
    unwritable output, an architecture feature the graph cannot express): the message names
    the option, path or feature. The CLI exits 2 on it, before writing anything."""


class VerificationError(AssertionError):
    """The exported artifact does not generate what the engine generates; the message says
    where the first difference is (prompt, step, layer, position). The CLI exits 1 on it."""
