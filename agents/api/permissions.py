"""Who may read what runs produced: the permission every results view checks."""

from __future__ import annotations

from typing import Any

from rest_framework.permissions import BasePermission, IsAuthenticated
from rest_framework.request import Request

from agents import services


class CanReadResults(BasePermission):
    """The caller's current permission to read runs and what they produced
    (``services.check_read_permission``: revoked → 403 ``run.read_forbidden``).

    Checked on lists before they are read, and on one object after the ownership-scoped
    lookup (``get_object``), so another user's object still answers 404. Every action on
    one session or run answers with its content (cancel and reply return the run), so
    every one of them is checked.
    """

    def has_permission(self, request: Request, view: Any) -> bool:
        if getattr(view, "action", None) == "list":
            services.check_read_permission(request.user)
        return True

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        services.check_read_permission(request.user)
        return True


READ_PERMISSIONS = [IsAuthenticated, CanReadResults]
