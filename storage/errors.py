"""The one error type for a run directory a user handed us that cannot be used as it is.

Every file a run directory holds can be damaged or edited by hand: truncated by a full
disk, cut mid-line by a crash, pointed at another file. Readers in storage/ raise
``RunDirError`` (or a subclass: ``CorruptSnapshotError``, ``SnapshotNotFoundError``) with
one line naming the file and what is wrong, so that a command line catches one type and
prints one line. It is a ``ValueError``: the input, not the program, is at fault.
"""

from __future__ import annotations


class RunDirError(ValueError):
    """A run directory's file is missing, damaged or points outside it; the message is one line
    naming the file (and the field or line) and what is wrong."""
