"""How an operation's outcome reaches the user: the events (automations and
the logbook) and the repair issues (the notification a user sees without
the dashboard: a request made by voice or by an automation fails long after
it was accepted), each named after the VM's device."""

from __future__ import annotations

from collections.abc import Sequence
import logging
from typing import Any, Final

from homeassistant.config_entries import ConfigEntry
from homeassistant.core import HomeAssistant
from homeassistant.exceptions import HomeAssistantError
from homeassistant.helpers import device_registry as dr, issue_registry as ir

from .cluster_client import ClusterConnectionError, ClusterError, UnmanagedPodsError
from .const import (
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_SUCCEEDED,
    EVENT_PREPARE_SUCCEEDED,
    EVENT_RETURN_SUCCEEDED,
    EVENT_RETURN_UNHEALTHY,
    EVENT_STOP_SUCCEEDED,
)
from .core import Hold, Kind, Request
from .health import UnhealthyReturn
from .jobs import JobFailedError
from .models import domain_identifier
from .runner import RunnerError
from .tower.gpu_handoff import wire
from .tower_client import TowerConnectionError, TowerError

_LOGGER = logging.getLogger(__name__)

ISSUE_HANDOFF_FAILED: Final = "handoff_failed"
ISSUE_UNMANAGED_PODS: Final = "unmanaged_pods"
# The code of a waiting request dropped because its VM was removed.
CODE_VM_REMOVED: Final = "vm_removed"
# The repair each kind of operation raises when it fails (one issue id per VM).
FAILED_ISSUES: Final = {
    Kind.HANDOFF: ISSUE_HANDOFF_FAILED,
    Kind.STOP: "stop_failed",
    Kind.RETURN: "return_failed",
    Kind.PREPARE: "prepare_failed",
}
# The event each kind of operation ends with when it succeeds.
SUCCEEDED_EVENTS: Final = {
    Kind.HANDOFF: EVENT_HANDOFF_SUCCEEDED,
    Kind.STOP: EVENT_STOP_SUCCEEDED,
    Kind.RETURN: EVENT_RETURN_SUCCEEDED,
    Kind.PREPARE: EVENT_PREPARE_SUCCEEDED,
}
# Failures the world heals by itself: the SSH connection or the agent's
# session dropped, the API server unreachable (or answering 5xx or 429),
# libvirt away for a moment (libvirtd restarting). An operation that meets
# one tries again (operations.Retry); reported, their codes are these.
TRANSIENT_CODES: Final = frozenset(
    {
        TowerConnectionError.__name__,
        ClusterConnectionError.__name__,
        wire.ERR_LIBVIRT_UNREACHABLE,
    }
)


def failure_code(err: Exception) -> str:
    """The code a failure is reported with (the ``code`` of the failed
    event): the agent's or the job's error code, else the error's type."""
    return getattr(err, "code", None) or type(err).__name__


def transient(err: Exception) -> bool:
    """Whether ``err`` is a failure the world heals by itself: its code is
    one of TRANSIENT_CODES (one list, which the reports carry too)."""
    return failure_code(err) in TRANSIENT_CODES


# Failures that are the world's, not a bug: a warning, not a traceback.
EXPECTED: Final = (
    HomeAssistantError,
    TowerError,
    ClusterError,
    RunnerError,
    JobFailedError,
)


class Reporter:
    """The events and repair issues of one tower's operations."""

    def __init__(self, hass: HomeAssistant, entry: ConfigEntry, k8s_node: str) -> None:
        """Report for ``entry``'s devices."""
        self._hass = hass
        self._entry = entry
        self._k8s_node = k8s_node

    def fire(self, event: str, vm: str, **data: Any) -> None:
        """Fire ``event`` for ``vm``'s device."""
        device = self._device(vm)
        self._hass.bus.async_fire(
            event,
            {
                "device_id": device.id if device is not None else None,
                "config_entry_id": self._entry.entry_id,
                "vm": vm,
                **data,
            },
        )

    def failed(self, vm: str, kind: Kind, err: Exception) -> str:
        """Log, fire and raise the repair of a failure; its message."""
        code = failure_code(err)
        message = str(err) or type(err).__name__
        if isinstance(err, EXPECTED):
            _LOGGER.warning("The %s of %s failed: %s", kind, vm, message)
        else:
            _LOGGER.error("The %s of %s failed unexpectedly", kind, vm, exc_info=err)
        if isinstance(err, UnmanagedPodsError):
            code = ISSUE_UNMANAGED_PODS
        self.fire(EVENT_HANDOFF_FAILED, vm, kind=kind, error=message, code=code)
        name = self._device_name(vm)
        if isinstance(err, UnmanagedPodsError):
            ir.async_create_issue(
                self._hass,
                DOMAIN,
                self._unmanaged_issue_id,
                is_fixable=False,
                is_persistent=False,
                severity=ir.IssueSeverity.ERROR,
                translation_key=ISSUE_UNMANAGED_PODS,
                translation_placeholders={
                    "vm": name,
                    "node": self._k8s_node,
                    "pods": ", ".join(err.pods),
                },
            )
            return message
        ir.async_create_issue(
            self._hass,
            DOMAIN,
            self._issue_id(vm),
            is_fixable=False,
            is_persistent=False,
            severity=ir.IssueSeverity.ERROR,
            translation_key=FAILED_ISSUES[kind],
            translation_placeholders={"vm": name, "error": message},
        )
        return message

    def dropped(self, vm: str, kind: Kind) -> str:
        """Log and fire that a request waiting for ``vm`` will not run: the
        VM was removed from GPU Handoff first (no repair: the user removed
        it). Its message."""
        message = f"{vm} was removed from GPU Handoff before its {kind} ran"
        _LOGGER.warning("The %s of %s was dropped: %s", kind, vm, message)
        self.fire(
            EVENT_HANDOFF_FAILED, vm, kind=kind, error=message, code=CODE_VM_REMOVED
        )
        return message

    def succeeded(
        self,
        request: Request,
        *,
        gpu_node: str,
        returned: bool,
        relend: bool,
        unhealthy: UnhealthyReturn | None,
        came_back: Sequence[str],
        hold: Hold | None = None,
    ) -> None:
        """The events of an operation that succeeded, and the repairs it
        clears. A return succeeds only when the cluster has its cards back:
        a GPU node that came back without advertising them is reported
        apart (``unhealthy``). A prepare's event says until when the cards
        are held (``hold``; none: its VM runs already)."""
        vm, kind = request.vm, request.kind
        if unhealthy is None or kind is not Kind.RETURN:
            # Pods that came back to the cordoned node are told, by name.
            self.fire(
                SUCCEEDED_EVENTS[kind],
                vm,
                kind=kind,
                **({"pods_came_back": list(came_back)} if came_back else {}),
                **({"hold_ends": hold.until} if hold is not None else {}),
            )
        if unhealthy is not None:
            self.fire(
                EVENT_RETURN_UNHEALTHY,
                gpu_node,
                kind=kind,
                reason=unhealthy.reason,
                error=unhealthy.message,
                gpus_expected=unhealthy.expected,
                gpus_allocatable=unhealthy.allocatable,
            )
        elif returned:
            self.fire(EVENT_CARDS_RETURNED, gpu_node)
        ir.async_delete_issue(self._hass, DOMAIN, self._issue_id(vm))
        if kind.hands_over or relend:
            # The pods that refused a handoff or a lend are gone (or were
            # evicted).
            ir.async_delete_issue(self._hass, DOMAIN, self._unmanaged_issue_id)

    def _device(self, vm: str) -> dr.DeviceEntry | None:
        """``vm``'s device (the GPU node's or a gaming VM's), if registered."""
        return dr.async_get(self._hass).async_get_device_by_identifier(
            domain_identifier(self._entry.entry_id, vm), self._entry.entry_id
        )

    def _device_name(self, vm: str) -> str:
        """What the user calls ``vm`` (its device's name, theirs if they
        renamed it), else its libvirt name."""
        device = self._device(vm)
        if device is None:
            return vm
        return device.name_by_user or device.name or vm

    @property
    def _unmanaged_issue_id(self) -> str:
        return f"{ISSUE_UNMANAGED_PODS}_{self._entry.entry_id}"

    def _issue_id(self, vm: str) -> str:
        return f"{ISSUE_HANDOFF_FAILED}_{self._entry.entry_id}_{vm}"
