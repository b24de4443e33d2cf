"""Typed views of what the tower agent and the cluster report; no Home Assistant."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .cluster_client import NodeView

RUNNING = "running"
SHUT_OFF = "shut_off"


@dataclass(frozen=True, kw_only=True)
class Card:
    """One PCI function: who holds it now, who claims it."""

    address: str
    held_by: str | None
    claimed_by: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class DomainState:
    """One managed libvirt domain."""

    name: str
    title: str
    exists: bool
    state: str | None
    reason: str | None
    agent_channel: bool
    agent_ready: bool | None
    cards: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class Job:
    """A detached job on the tower."""

    id: str
    kind: str
    args: tuple[str, ...]
    state: str
    step: str | None


@dataclass(frozen=True, kw_only=True)
class Finding:
    """A configuration problem the agent found."""

    code: str
    domain: str | None
    detail: str


@dataclass(frozen=True, kw_only=True)
class TowerStatus:
    """The agent's ``status`` reply."""

    gpu_node: str
    gaming: tuple[str, ...]
    domains: dict[str, DomainState]
    cards: tuple[Card, ...]
    findings: tuple[Finding, ...]
    active_jobs: tuple[Job, ...]
    hook_requests: tuple[dict[str, Any], ...] = ()

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> TowerStatus:
        """Parse the agent's reply (fields it does not send get neutral values)."""
        domains = {
            str(d["name"]): DomainState(
                name=str(d["name"]),
                title=str(d.get("title") or d["name"]),
                exists=bool(d.get("exists", True)),
                state=d.get("state"),
                reason=d.get("reason"),
                agent_channel=bool(d.get("agent_channel")),
                agent_ready=d.get("agent_ready"),
                cards=tuple(str(dev["address"]) for dev in d.get("hostdevs", [])),
            )
            for d in reply.get("domains", [])
        }
        return cls(
            gpu_node=str(reply["gpu_node"]),
            gaming=tuple(reply.get("gaming", [])),
            domains=domains,
            cards=tuple(
                Card(
                    address=str(c["address"]),
                    held_by=c.get("held_by"),
                    claimed_by=tuple(c.get("claimed_by", [])),
                )
                for c in reply.get("cards", [])
            ),
            findings=tuple(
                Finding(
                    code=str(f["code"]),
                    domain=f.get("domain"),
                    detail=str(f.get("detail", "")),
                )
                for f in reply.get("findings", [])
            ),
            active_jobs=tuple(
                Job(
                    id=str(j["id"]),
                    kind=str(j["kind"]),
                    args=_job_args(j.get("args")),
                    state=str(j["state"]),
                    step=j.get("step"),
                )
                for j in reply.get("active_jobs", [])
            ),
            hook_requests=tuple(reply.get("hook_requests", [])),
        )

    def cards_held_by(self, domain: str) -> tuple[Card, ...]:
        """The PCI functions ``domain`` holds now."""
        return tuple(card for card in self.cards if card.held_by == domain)

    def gpus_held_by(self, domain: str) -> int:
        """Cards (PCI devices, each with its functions) ``domain`` holds now."""
        return len(
            {card.address.rsplit(".", 1)[0] for card in self.cards_held_by(domain)}
        )

    def job_for(self, domain: str) -> Job | None:
        """The active job acting on ``domain`` (a stop, start, handoff or release)."""
        for job in self.active_jobs:
            if domain in job.args or (
                domain == self.gpu_node and job.kind in ("handoff", "release")
            ):
                return job
        return None


def _job_args(args: Any) -> tuple[str, ...]:
    """The domains a job acts on. The agent sends ``{"domain": name}`` (name
    None for a release with no gaming VM); a list is read as it is."""
    values = args.values() if isinstance(args, dict) else args or []
    return tuple(str(value) for value in values if value is not None)


@dataclass(frozen=True, kw_only=True)
class Snapshot:
    """Everything the entities show, from one update."""

    tower: TowerStatus
    node: NodeView | None
    cluster_error: str | None = None
