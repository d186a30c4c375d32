"""An engine worker's role and, elastic (docs/elastic.md), the switch being drained: each request
keeps the role it was taken in, and a switch is over once the worker holds none of what it held
when the switch came."""

from __future__ import annotations

import time
from dataclasses import dataclass

from epdserve.serving.deployment import ENGINE_ROLES


@dataclass
class Switch:
    """``arrival``: ``time.perf_counter()`` of the SetRole; ``held``: the request ids the worker
    held then, all of ``previous``'s work."""

    previous: str
    switch_id: str
    arrival: float
    held: set[str]

    @property
    def drain_ms(self) -> float:
        return (time.perf_counter() - self.arrival) * 1e3


class Roles:
    """``role``: one of :data:`ENGINE_ROLES` (ValueError otherwise); ``switch``: the one being
    drained, or None."""

    def __init__(self, role: str):
        if role not in ENGINE_ROLES:
            raise ValueError(f"unknown role {role!r} (choose from {', '.join(ENGINE_ROLES)})")
        self.role = role
        self.switch: Switch | None = None
        self._taken_as: dict[str, str] = {}

    def take(self, request_id: str) -> None:
        """Taken now, in the current role; it reaches the engine later."""
        self._taken_as.setdefault(request_id, self.role)

    def role_of(self, request_id: str) -> str:
        """The role it was taken in (the current one if taken at once), forgotten: it reaches the engine now."""
        return self._taken_as.pop(request_id, self.role)

    def forget(self, request_id: str | None = None) -> None:
        """The request, or every request."""
        if request_id is None:
            self._taken_as.clear()
        else:
            self._taken_as.pop(request_id, None)

    def begin(self, role: str, switch_id: str, arrival: float, holding: set[str]) -> None:
        """A second switch while one drains redirects it: the work of both older roles drains."""
        previous = self.switch.previous if self.switch else self.role
        held = holding | (self.switch.held if self.switch else set())
        self.role = role
        self.switch = Switch(previous, switch_id, arrival, held)

    def drained(self, holding: set[str]) -> Switch | None:
        """The switch, once ``holding`` has none of the old role's work; else None."""
        switch = self.switch
        if switch is None:
            return None
        switch.held &= holding
        if switch.held:
            return None
        self.switch = None
        return switch
