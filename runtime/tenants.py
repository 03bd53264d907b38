"""Tenants of a shared server: who may connect, with what memory quota, weight and priority.

``gpu-trace serve --tenants tenants.toml`` reads them (:func:`load_tenants`); without a file the
server has one tenant, ``default``, with the server's token and no quota (:func:`single_tenant`).
A tenant's memory quota is a fraction of the device's memory or a number of bytes; it is
resolved against the device's capacity when the server starts (:meth:`Tenant.limit_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

#: What a tenant's op does when it would go over the tenant's memory quota.
ON_QUOTA = ("fail", "wait")


@dataclass(frozen=True)
class Tenant:
    """One tenant: a name, the token its clients authenticate with, and its share of the GPU.

    ``memory_fraction`` (0 < f <= 1, of device memory) and ``memory_bytes`` are exclusive;
    neither means no quota. ``weight`` is the compute share for weighted policies (> 0);
    ``priority`` is a strict class, higher first. ``on_quota`` is ``fail`` or ``wait``;
    ``wait_s`` bounds a wait. ``idle_s`` is how long a session may sit idle before its tensors
    are paged out to host memory (None: the server's default). ``admin`` tenants may list and
    evict every tenant's sessions.
    """

    name: str
    token: str
    memory_fraction: float | None = None
    memory_bytes: int | None = None
    weight: float = 1.0
    priority: int = 0
    on_quota: str = "fail"
    wait_s: float = 60.0
    idle_s: float | None = None
    admin: bool = False

    def limit_bytes(self, capacity: int) -> int | None:
        """The quota in bytes on a device with ``capacity`` bytes; None: no quota."""
        if self.memory_bytes is not None:
            return self.memory_bytes
        if self.memory_fraction is not None:
            return int(self.memory_fraction * capacity)
        return None


def single_tenant(token: str) -> list[Tenant]:
    """The tenants of a server started without a tenants file: everyone is ``default``."""
    return [Tenant(name="default", token=token, admin=True)]
