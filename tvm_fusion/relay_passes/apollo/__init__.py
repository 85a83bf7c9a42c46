"""Apollo (MLSys'22): partition-based fusion. ``partition`` holds the three layers of
partitioning (Algorithms 1–3), ``classify`` the operator classes, ``stitch`` the stitching of
independent blocks, and ``feedback`` :class:`ApolloFuse`, which plans, fuses and schedules with
the loop scheduler's feedback."""

from .feedback import ApolloFuse
from .partition import ApolloOptions

__all__ = ["ApolloFuse", "ApolloOptions"]
