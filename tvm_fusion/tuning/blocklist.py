"""Apollo's feedback blocklist kept in the profiling database (table ``apollo_blocklist``).

A merge the fusion phase rejected is never tried again by any later build for the same target.
The build (``tvm_fusion.transform``) creates it and hands it to ``ApolloFuse``, which sees only
the :class:`~tvm_fusion.relay_passes.apollo.feedback.Blocklist` protocol: the planner does not
import the database.
"""

from __future__ import annotations

import os

from ..relay_passes.apollo.feedback import MemoryBlocklist
from .database import ProfilingDatabase


class DatabaseBlocklist(MemoryBlocklist):
    """The entries of ``target`` in the database at ``db_path`` (read once); every added one
    is written through."""

    def __init__(self, db_path: str, target: str):
        super().__init__()
        self.db_path = db_path
        self.target = target
        if os.path.exists(db_path):
            with ProfilingDatabase(db_path, create=False) as db:
                self.entries.update({e["signature"]: e["reason"] for e in db.blocklist(target)})

    def add(self, signature: str, reason: str) -> None:
        super().add(signature, reason)
        with ProfilingDatabase(self.db_path) as db:
            db.blocklist_add(self.target, signature, reason)
