"""What the controller owns for one tower, and where it is stored.

The desired set, the operation in flight (core.Plan), the requests accepted
and not finished, the cards held for a gaming VM (core.Hold), whether the GPU node is off because a tower job of GPU
Handoff's shut it down, and what the controller remembers between updates
(core.Memory). Stored as core.Owned, versioned (core.migrate_store).
"""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any

from homeassistant.config_entries import ConfigEntry
from homeassistant.core import HomeAssistant
from homeassistant.exceptions import HomeAssistantError
from homeassistant.helpers.storage import Store
from homeassistant.util import dt as dt_util

from .cluster_model import SKIP_WAIT_FOR_DELETE
from .const import (
    CONF_AUTO_RETURN,
    CONF_DOMAIN_NAME,
    CONF_DRAIN_TIMEOUT,
    CONF_EVICT_UNMANAGED,
    CONF_HANDOFF_WHEN_CORDONED,
    CONF_LEND_FREE_CARDS,
    DEFAULT_AUTO_RETURN,
    DEFAULT_DRAIN_TIMEOUT,
    DEFAULT_EVICT_UNMANAGED,
    DEFAULT_HANDOFF_WHEN_CORDONED,
    DEFAULT_LEND_FREE_CARDS,
    DOMAIN,
)
from .coordinator import GpuHandoffCoordinator
from .core import (
    STORE_VERSION,
    Hold,
    JobFacts,
    Kind,
    Memory,
    Observed,
    Origin,
    Owned,
    Plan,
    Request,
    Settings,
    gpu_stopped_by_us,
    migrate_store,
)

_LOGGER = logging.getLogger(__name__)

# How long a pod may sit terminating past its deletion time before the drain
# stops waiting for it (its kubelet is not reporting): kubectl's
# --skip-wait-for-delete-timeout.
SKIP_WAIT: float = SKIP_WAIT_FOR_DELETE


class HandoffStore(Store[dict[str, Any]]):
    """A tower's owned records (core.Owned), migrated from earlier versions."""

    async def _async_migrate_func(
        self, old_major_version: int, old_minor_version: int, old_data: dict[str, Any]
    ) -> dict[str, Any]:
        return migrate_store(old_major_version, old_data)


def handoff_store(hass: HomeAssistant, entry_id: str) -> HandoffStore:
    """Where a tower's desired state and operation in flight are kept."""
    return HandoffStore(hass, STORE_VERSION, f"{DOMAIN}.{entry_id}")


def settings_of(options: MappingProxyType[str, Any]) -> Settings:
    """What the entry's options say an operation follows."""
    return Settings(
        drain_timeout=float(options.get(CONF_DRAIN_TIMEOUT, DEFAULT_DRAIN_TIMEOUT)),
        evict_unmanaged=bool(
            options.get(CONF_EVICT_UNMANAGED, DEFAULT_EVICT_UNMANAGED)
        ),
        handoff_when_cordoned=bool(
            options.get(CONF_HANDOFF_WHEN_CORDONED, DEFAULT_HANDOFF_WHEN_CORDONED)
        ),
        auto_return=bool(options.get(CONF_AUTO_RETURN, DEFAULT_AUTO_RETURN)),
        skip_wait=SKIP_WAIT,
        lend_free=bool(options.get(CONF_LEND_FREE_CARDS, DEFAULT_LEND_FREE_CARDS)),
    )


class OwnedState:
    """The controller's records for one tower, shared by the loop that
    decides (controller) and the one that carries operations out
    (operations)."""

    def __init__(
        self,
        hass: HomeAssistant,
        entry: ConfigEntry,
        coordinator: GpuHandoffCoordinator,
    ) -> None:
        """Empty until ``load``."""
        self.coordinator = coordinator
        self._entry = entry
        self._store = handoff_store(hass, entry.entry_id)
        self.desired: set[str] = set()
        self.plan: Plan | None = None
        self.gpu_stopped_by_us = False
        self.gpu_started_at: str | None = None
        # Requests accepted and not finished (queued or running), by VM. The
        # switch shows them at once, before any step has run; those that are
        # not the plan's wait.
        self.requests: dict[str, Request] = {}
        self.memory = Memory()
        # Cards held for a gaming VM after a prepare.
        self.hold: Hold | None = None

    async def load(self) -> Owned:
        """What was stored (the waiting requests are the caller's to take)."""
        stored = await self._store.async_load()
        owned = Owned.from_dict(stored) if stored is not None else Owned()
        self.desired = set(owned.desired)
        self.plan = owned.plan
        self.gpu_stopped_by_us = owned.gpu_stopped_by_us
        self.gpu_started_at = owned.gpu_started_at
        self.hold = owned.hold
        seen = owned.seen_hook_requests
        if seen is None:
            # A first start, or a store of 0.3.x: what the tower shows counts
            # as seen (the controller stores it at once).
            hooks = self.coordinator.data.tower.hook_requests
            seen = frozenset(request.key for request in hooks)
        self.memory = Memory(seen_hook_requests=seen)
        return owned

    def forget_unknown_vms(self) -> None:
        """Drop VMs no longer defined on the tower from the desired set. A
        VM removed from GPU Handoff stays until the first update: if it was
        removed while it played and is off now, its session ended (the
        player quit while Home Assistant reloaded): the update returns the
        cards and forgets it (core.reconcile, core.known_desired)."""
        domains = self.coordinator.data.tower.domains
        known = {
            vm
            for vm in self.desired
            if (state := domains.get(vm)) is not None and state.exists
        }
        if known != self.desired:
            _LOGGER.info("Forgetting %s", ", ".join(sorted(self.desired - known)))
            self.desired = set(known)

    def owned(self) -> Owned:
        """What is owned now, as it is stored."""
        running = self.plan.vm if self.plan is not None else None
        # Only those the tower still keeps (it forgets them after a while).
        shown = {request.key for request in self.coordinator.data.tower.hook_requests}
        return Owned(
            desired=frozenset(self.desired),
            plan=self.plan,
            queue=tuple(r for vm, r in self.requests.items() if vm != running),
            gpu_stopped_by_us=self.gpu_stopped_by_us,
            seen_hook_requests=self.memory.seen_hook_requests & shown,
            gpu_started_at=self.gpu_started_at,
            hold=self.hold,
        )

    def record_facts(self, facts: JobFacts, request: Request) -> None:
        """What ``request``'s jobs did, once it ends: whether the GPU node is
        off because of them (or theirs to start: core.gpu_stopped_by_us), and
        when they last started it."""
        self.gpu_stopped_by_us = gpu_stopped_by_us(
            self.owned(), facts, self.coordinator.data.tower, request
        )
        self.gpu_started_at = facts.since(self.gpu_started_at).gpu_started_at

    def observed(self) -> Observed:
        """The tower and cluster as the last update showed them."""
        data = self.coordinator.data
        return Observed(
            tower=data.tower,
            node=data.node,
            configured=frozenset(self.configured_vms),
            settings=self.settings,
            now=dt_util.utcnow(),
        )

    @property
    def held_vm(self) -> str | None:
        """The gaming VM cards are held for, if any."""
        return self.hold.vm if self.hold is not None else None

    @property
    def configured_vms(self) -> set[str]:
        """The gaming VMs the user added to this tower (one subentry each)."""
        return {
            str(sub.data[CONF_DOMAIN_NAME]) for sub in self._entry.subentries.values()
        }

    @property
    def settings(self) -> Settings:
        """What the options say an operation follows."""
        return settings_of(self._entry.options)

    def request_done(self, request: Request) -> None:
        """``request`` ended (another for the same VM may wait behind it)."""
        current = self.requests.get(request.vm)
        if current is not None and current.kind is request.kind:
            del self.requests[request.vm]

    def return_plan(self) -> Plan:
        """The return GPU Handoff decides on after an operation."""
        gpu_node = self.coordinator.data.tower.gpu_node
        return Plan(
            request=Request(vm=gpu_node, kind=Kind.RETURN, origin=Origin.GPU_HANDOFF)
        )

    async def save(self) -> None:
        """Store what is owned now."""
        await self._store.async_save(self.owned().as_dict())

    async def save_in_background(self) -> None:
        """Save what reconciling learned; a failed write is logged (the next
        change writes it again), not left as an unretrieved task error."""
        try:
            await self.save()
        except (OSError, HomeAssistantError) as err:
            _LOGGER.warning("Could not store GPU Handoff's state: %s", err)
