"""The chaos soak's harness: the whole product through many handoff and return
cycles, faults injected at random moments, invariants checked all along.

The rig is the product with its real parts, as in the end-to-end stories:
Home Assistant with the integration (the test instance; its storage survives
a restart, which is an unload and a setup of the same entry), a real sshd
forcing the real agent, the tower simulator (guests 100x faster than real
ones) behind a ``virsh`` wrapper that can make libvirt unavailable, the
Kubernetes API emulator behind a TCP proxy that can make it unreachable, two
gaming VMs, a kubelet stand-in (tests/support/kubelet.py: when its VM stops
the GPU node's Kubernetes node stays Ready until the grace period ends, then
Unknown; after each boot it is Ready with a new bootID and no GPUs, then the
cards once the device plugin registered, at delays drawn from the seed) and
a ReplicaSet stand-in (evicted workload pods come back once the GPU node
serves again).

The GPU node's pods (the demo cluster's and the soak's own, ``TOLERANT`` and
``EXPORTER``, added at the start with fixed names: nothing is drawn for them,
so the plans are the seed's alone): the NVIDIA device plugin and a node
exporter, DaemonSet pods on the host network (the drain skips them, a boot
starts them before the pod network is up); two GPU workloads of ReplicaSets,
one guarded by a PodDisruptionBudget, recreated between cycles once the GPU
node serves uncordoned; a mirror pod; and a Deployment's pod that tolerates
the cordon (``node.kubernetes.io/unschedulable:NoSchedule``), for which the
kubelet stand-in plays the ReplicaSet controller and the scheduler as their
watches do: once the drain evicts it, its replacement is bound to the
cordoned node at once, the drain leaves it there (``pods_came_back``) and it
stops with the node. Every pod but the DaemonSets' and the mirror pod's
tolerates the unreachable taint for the 300 s admission gives it (3 s at
the emulator fixture's pace): a GPU node off longer has the taint eviction
controller delete its pods (Terminating until the kubelet is back).

Each cycle draws, from ``random.Random(f"...:{seed}:{cycle}")`` alone, one
request and 0-3 faults, each bound to a moment of the operation: ``before``
the request is sent, while ``draining``, at ``job`` (the drain is done and the
tower job's request id stored, the job not yet asked for), ``mid_job`` (the
tower job runs), at ``node_return`` (waiting for the GPU node's Kubernetes
node) or at ``gpu_wait`` (the node is Ready from its new boot, and the
return waits under GPU Handoff's cordon for the device plugin to register
the GPUs: the ``waiting_for_gpus`` step; with lending, the restart with the
free cards after a handoff is such a return too). A handoff's faults are
drawn among the first four, a return's among all but ``draining``. The
operator's shutdown of the GPU node always strikes while draining, a gaming
VM's removal always while the tower job runs, and a player starting while
the GPUs come back always at ``gpu_wait``: the other gaming VM's switch
turned on (``player_starts``) or the other gaming VM started by hand on the
tower (``hand_start``), each a request of the cycle as the plan's own are
(checked as they are: carried out or reported). The same seed and cycle give
the same request and the same faults at the same moments; a moment the
operation never reaches leaves its fault unfired ("unreached" in the
summary), and a fault whose precondition does not hold at its moment
(nobody else plays, the GPU node is off already, the VM to start runs
already) does nothing ("inapplicable"). A request overridden by a later one
of the cycle (the VM just turned off started again; a gaming VM turned on
after ``return_cards``), or by its player (a switch turned on while its
player was already quitting from inside, the VM still ``running`` to
libvirt), is not judged ("superseded").

Prepare ahead: a quarter of the cycles (``PREPARE_ODDS``, drawn from a
generator of their own, so that every other cycle of a seed is what it was
before) prepare a gaming VM (``HandoffController.async_prepare``: the action
``gpu_handoff.prepare`` takes whole minutes, the soak's holds last 2-4 s)
and, once the cards are held (or the prepare is over without a hold), after
a drawn part of the hold, do one of ``PREPARE_REQUESTS``: turn that VM on
(within the hold it only starts), let the hold expire (the cards go back),
turn the other gaming VM on, ``return_cards``, or turn the held VM off; the
follow-up is a request of the cycle as the plan's own are. Their faults are
drawn among all six moments (the prepare drains and stops the GPU node; the
return after an expired hold or ``return_cards``, and with lending the GPU
node's restart with the free cards after the prepare, reach ``node_return``
and ``gpu_wait``). A prepare whose VM plays while the other does not runs
mirrored (``mirror``: the two gaming VMs swapped, in its faults too); both
playing, its player quits first (its switch off, a request of the cycle; a
prepare of a VM that plays is refused, ``vm_plays``, which the race with a
start by hand still meets). A cycle goes on while cards are held:
every change of the controller's hold is traced at its instant, and GPU
Handoff is sampled busy or idle meanwhile (``HoldSeen``).

Three faults change how libvirt and the guests answer a stop. A slow
graceful stop (``slow_graceful_stop``) makes the target's (the GPU node's or
the cycle's gaming VM's) next graceful shutdowns take longer than libvirt's
60 s agent-shutdown wait (scaled: ``virsh shutdown --mode agent`` then fails
with "Guest agent is not responding" while the guest goes on powering off;
a guest whose agent stops first, as Windows does, has libvirt accept at
once instead) and less than the agent's shutdown timeout; the usual
duration is back before the cycle after next. A player racing the stop
(``guest_quits_racing_stop``) shuts their gaming VM down from inside at the
instant GPU Handoff's ``virsh shutdown`` of it arrives (only a request of the
cycle that turns it off); a race no stop came for is undone at the end of
the cycle. A libvirtd restart (``libvirtd_restart``) ends every ``virsh
event --loop`` ("Disconnected from qemu:///system due to end of file"),
fails (or, socket-activated, holds) every virsh call while it is away, keeps
the domains running, and runs the qemu hook's ``reconnect begin -`` for each
when it is back. These three strike before the stop they change is sent
(``EARLY_MOMENTS``) or, the restart, at any moment.

Apart from the faults, a quarter of the cycles (``Plan.socket_race``, drawn
from a generator of its own so that the seeds' requests and faults stay
what they were) have every ``shutdown --mode agent`` lose libvirt's race
with QEMU's exit: the guest powers off and the call fails with "internal
error: End of file from agent socket", as a real guest did under load.

A start by hand is ``virsh start`` on the tower: the simulator runs libvirt's
qemu hook (the agent) as libvirtd does, and refuses the start while the GPU
node holds the VM's cards. A gaming VM removed from GPU Handoff is added back
(its subentry as it was) at the end of the cycle, before the next one.

Invariants and how they are observed:

- ``destroy_sent``: the simulator records every virsh command; none may be a
  ``destroy`` or ``reset`` (the simulator refuses them, but asking is the bug).
- ``stop_before_guest_agent``: no ``shutdown`` reaches a running domain whose
  guest agent is not connected at that instant (the command's time replayed
  in the simulator's world), unless a ``guest-ping`` of it answered just
  before (within ``PING_TO_SHUTDOWN``, the agent connected at the ping's
  end, in the same boot): the guest let its agent go between the two (a
  player quitting, the operator's shutdown from inside), which no caller can
  rule out. libvirt settles that race itself: it refuses the shutdown with
  "QEMU guest agent is not connected" (qemuDomainShutdownFlagsAgent), and
  the agent then waits for the guest to go down.
- ``pod_left_without_eviction``, ``unmanaged_pod_evicted``: a listener on the
  emulator's store sees every pod of the GPU node start terminating or go;
  each needs an eviction the API server accepted (its recorded requests), and
  no accepted eviction may name a pod nothing recreates (the option is off).
  The cluster's own deletions are not GPU Handoff's: a pod the taint
  eviction controller marks (a DisruptionTarget condition, reason
  DeletionByTaintManager, while the node carries the unreachable NoExecute
  taint) and later the kubelet finishes is counted
  (``pods_deleted_by_taint_manager``), not held against it; nor are the
  operator's forced deletions after its shutdown.
- ``came_back_evicted``: a pod a drain left because it came back to the
  cordoned node tolerating the cordon (the ``pods_came_back`` of the event
  that ends the handoff) was never named by an eviction request of that
  drain (the API server's record since its ``draining`` step). Counted:
  ``pods_came_back``, and the returns that waited for the node
  (``node_waits``) and for its GPUs (``gpu_waits``).
- ``operator_cordon_lifted``: the same listener sees every change of the
  Node; while the operator's cordon is on, nothing may make it schedulable.
- ``own_cordon_outlives``: once settled with the GPU node serving (running,
  Ready), GPU Handoff's marked cordon must be gone (the safety net may take
  one poll interval).
- ``rollback_under_running_job``: the same listener notes when GPU Handoff's
  cordon is lifted; no tower job that may stop the GPU node (a handoff, a
  stop of the GPU node) may have been running at that instant (the job
  records' start and end times).
- ``duplicate_job``, ``overlapping_jobs``, ``unfinished_job``: the agent's job
  records (read with its ``jobs`` verb, which settles dead runners, and as
  files for the running intervals), kept across pruning: one job per request
  id, no two jobs running at once on the tower, none left queued or running.
- ``unsettled``, ``half_state``, ``silent_failure``, ``switch_wrong``: every
  cycle must end idle within a bound, with a requested gaming VM running or
  the GPU node serving; a request not fulfilled must have been reported (a
  ``handoff_failed`` event, ``last_error``, and a repair where the user must
  act); a switch never shows a request nothing works on.
- ``passing_failure_reported``: a request reported failed with a passing
  failure's code (``report.TRANSIENT_CODES``: the tower, its agent session,
  libvirt or the API server away) must have met outages (``OUTAGES``, each
  its ``seconds`` and RECONNECT more) longer in all than the bound of the
  product's retries, the drain timeout. The summary counts such failures as
  ``failed_transient``, the others as ``failed_by_the_world``.
- ``leaked_process``, ``leaked_runner``, ``lock_held``, ``leaked_task``: once
  settled, no agent process but the session (and its ``virsh event``), no job
  runner or loaded unit, no job lock held, no operation task of Home Assistant.
- ``loop_blocked``: a task sleeping 10 ms at a time measures how late Home
  Assistant's event loop wakes it, and a thread sleeping beside it how late
  the machine's load alone makes a sleeper: the largest part of a lag that
  was the loop's own must stay under ``LAG_LIMIT`` per cycle (the harness
  itself does its blocking work in threads; see LoopLag).
- ``handoff_unasked``: no handoff without an ask. Every ``handoff_started``
  event of kind handoff (the bus) and every start or create of a gaming VM
  on the tower (the simulator's own record of each, with its time) must come
  after a request of this cycle to turn that VM on was sent (a switch, the
  ``start_handoff`` action, or the harness's own ``virsh start`` by hand).
- ``returned_before_new_boot``, ``returned_while_off``: when a
  ``cards_returned`` event fires, the harness reads the Node in the API
  server's store at that instant: it must be Ready=True with a bootID other
  than the one the store held just before the GPU node's VM last started
  (the store's bootID history from the store listener; the start's time from
  the simulator's replay of that instant), and that replay must show the VM
  running.
- ``cards_not_lent`` (lending on, someone plays): at idle at the end of a
  cycle the GPU node serves exactly the free cards (the cards of its live
  hostdevs equal the cards of its persistent definition minus those running
  gaming VMs hold; none free: it is off), or a failure is on report (a
  ``handoff_failed`` event this cycle, a ``last_error``, a repair issue of the
  entry; one on report stays so until the GPU node serves the free cards
  again, as a restart forgets ``last_error``), or the operator shut it down.
- ``operator_stop_undone``: a GPU node the operator shut down (the
  ``operator_stop`` fault) is not started by a tower job of GPU Handoff's (a
  ``start`` or ``start_free`` step of the GPU node that started it, in the
  agent's job records) until a request asks for the cards back: GPU Handoff
  returns them on an edge, ``return_cards`` or a session it knows of ending
  (a running gaming VM turned off, a player quitting from inside). Taken
  conservatively: a start is not held against GPU Handoff when such a
  request of the same cycle came before the shutdown (the operator stopped a
  return under way), or when the GPU node accepted a shutdown of GPU
  Handoff's own after the operator's (its job stopped it too). The operator
  starts the GPU node again at the end of a cycle nobody plays in; while
  someone plays it stays off, and a cycle that ends with it off and nobody
  playing is no ``half_state``.

- ``slow_stop_refused``: while a guest's graceful stop takes longer than
  libvirt's agent-shutdown wait and less than the agent's shutdown timeout
  (``slow_graceful_stop``, or a ``guest_shutdown`` that slow), no
  ``shutdown`` or ``wait_shut_off`` step of it fails (no
  ``shutdown_refused``, no ``shutdown_timeout``) unless libvirt was away in
  that cycle. Counted: ``slow_stop_outlasted_libvirt`` (libvirt gave up, the
  agent waited for the power-off), ``slow_stop_accepted`` (libvirt accepted:
  the guest's agent left first), ``slow_stop_failed``.
- ``race_stop_failed``: a stop that raced the player's own shutdown ends
  as a plain stop does: the VM off, no failed step of it and no
  ``shutdown_refused``/``shutdown_timeout`` reported for it, and when nobody
  plays at the end, the GPU node running with its cards returned
  (``cards_returned`` or ``return_unhealthy`` after the race). Excused:
  libvirt away, a shutdown that outlasts the agent's timeout anyway, the VM
  removed; the return part also by another failure reported, a restart of
  Home Assistant, the operator's shutdown of the GPU node.
- ``slow_recovery_after_libvirtd``: once libvirtd is back from a restart,
  every entity of the tower (but the screens and those that need the
  cluster) is available within ``RECOVERY_BOUND`` seconds. The harness
  samples the states while libvirtd is away and after, and keeps what it
  measured in the cycle's record and the summary (``libvirtd_restarts``); a
  cycle whose faults take the agent session away by themselves
  (``SESSION_FAULTS``) is measured and not judged.
- ``killed_on_reconnect``: libvirtd back from a restart kills no domain (a
  ``reconnect`` hook that fails makes it: qemuProcessReconnect).
- ``hold_outlived``: once its time is over and GPU Handoff is idle (nothing
  running or waiting, its lock free, the entry loaded), a hold ends within
  ``HOLD_LATE`` (1.6 s: the controller looks again every second while it is
  busy and a second after an operation's end, plus the loop's lateness and
  the sampling); an operation in flight at its time delays it by what is
  left of that operation (bounded by its own bounds, judged by
  ``unsettled``). The summary's ``holds`` keeps how each ended and how late.
- ``cards_not_back_after_hold``: a hold that ended unused (its time over:
  ``gpu_handoff_hold_expired``; or its VM removed from GPU Handoff) brings the
  cards back as a session's end does (it is a request for them back, as
  ``operator_stop_undone`` counts them): by the cycle's end the GPU node runs
  with the held VM's cards, Ready, GPU Handoff's cordon gone, and
  ``cards_returned`` (or ``return_unhealthy``) fired after the hold's end;
  excused when someone plays at the end, the operator's shutdown stands, or a
  failure was reported after the hold's end.
- ``held_card_taken``: while cards are held, the GPU node never runs with one
  of them (lending off, it does not run; on, it is lent the free cards but
  the held VM's): the simulator's replay at the hold's beginning and at every
  start or create of the GPU node while it lasts. A prepare is fulfilled once
  the cards were held (or its event says it needed no hold); one whose VM
  was removed while it ran holds nothing and is not judged.

Each violation carries the command that replays it with every option of the
run (``--lend``; ``GPU_HANDOFF_CHAOS_LAG_LIMIT`` if not the default), and the
request and faults of its cycle as planned; the progress line of a violation
ends with that command.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
import contextlib
import dataclasses
from dataclasses import dataclass, field
import datetime as dt
import fcntl
import itertools
import json
import os
from pathlib import Path
import random
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from types import MappingProxyType
from typing import Any, Final

from homeassistant.config_entries import ConfigEntryState, ConfigSubentry
from homeassistant.core import Event, HomeAssistant, callback
from homeassistant.exceptions import HomeAssistantError
from homeassistant.helpers import entity_platform, issue_registry as ir
from pytest_homeassistant_custom_component.common import MockConfigEntry
import yaml

from custom_components.gpu_handoff.cluster_client import CORDON_ANNOTATION
from custom_components.gpu_handoff.const import (
    CONF_AUTO_RETURN,
    CONF_DOMAIN_NAME,
    CONF_DRAIN_TIMEOUT,
    CONF_KUBECONFIG,
    CONF_LEND_FREE_CARDS,
    CONF_SCAN_INTERVAL,
    DOMAIN,
    EVENT_CARDS_RETURNED,
    EVENT_HANDOFF_FAILED,
    EVENT_HANDOFF_STARTED,
    EVENT_HANDOFF_STEP,
    EVENT_HANDOFF_SUCCEEDED,
    EVENT_HOLD_EXPIRED,
    EVENT_PREPARE_SUCCEEDED,
    EVENT_RETURN_UNHEALTHY,
)
from custom_components.gpu_handoff.controller import HOLD_BUSY_RETRY
from custom_components.gpu_handoff.operations import STEP_RETRYING
from custom_components.gpu_handoff.report import TRANSIENT_CODES
from tests.conftest import gaming_subentries, tower_entry_data
from tests.k8semu import GPU_NODE, K8sEmulator
from tests.k8semu.objects import UNREACHABLE_NO_EXECUTE, UNSCHEDULABLE_TAINT
from tests.support.kubelet import NETWORK_DELAY, SANDBOX_RETRY, Kubelet, Workload
from tests.support.simtower import install_hook, write_agent_config
from tests.support.sshd import Sshd
from tests.support.testdriver import AGENT
from tests.towersim import Tower, model as sim_model, realistic_tower

# --- the rig's pace ------------------------------------------------------------

TIME_SCALE: Final = 0.01  # simulated seconds per real one: guests 100x faster
# stop_before_guest_agent: the longest a ping's answer may precede the
# shutdown it cleared (the agent's next step, a job record written between;
# seconds, on a loaded machine).
PING_TO_SHUTDOWN: Final = 2.0
DEFAULT_AGENT_DELAY: Final = 30.0  # simulated seconds (0.3 s real)
DEFAULT_SHUTDOWN: Final = 10.0  # simulated seconds (0.1 s real)
# The agent's own timeouts (real seconds): short, so faults end in seconds.
AGENT_TIMEOUTS: Final = {"agent": 3.0, "shutdown": 3.0, "start": 10.0}
DRAIN_TIMEOUT: Final = 8  # the option, seconds
SCAN_INTERVAL: Final = 30  # the option's default
# The GPU node's kubelet and the control plane, in simulated seconds (times
# TIME_SCALE): the kubelet's first status post after a boot, then the NVIDIA
# device plugin's registration (drawn per boot); kube-controller-manager's
# --node-monitor-grace-period and --node-monitor-period.
KUBELET_FIRST_POST: Final = (10.0, 20.0)
DEVICE_PLUGIN_AFTER: Final = (3.0, 60.0)
NODE_MONITOR_GRACE: Final = 50.0
NODE_MONITOR_PERIOD: Final = 5.0
SETTLE_BOUND: Final = 90.0  # a cycle must be idle this long after it began
QUIET: Final = 1.0  # idle this long without a break counts as settled
CORDON_NET_BOUND: Final = SCAN_INTERVAL + 10.0  # the safety net runs on the poll
LEAK_GRACE: Final = 5.0
SWITCH_GRACE: Final = 6.0  # the agent session's refresh (5 s) and a little
ONE_SHOT_AGE: Final = 15.0  # a one-shot agent process older than this leaked
DEFAULT_LAG_LIMIT: Final = 0.5
LAG_LIMIT: Final = float(
    os.environ.get("GPU_HANDOFF_CHAOS_LAG_LIMIT", str(DEFAULT_LAG_LIMIT))
)
# A hold's end (hold_outlived): the controller looks at a hold on a timer, at
# its end and, while an operation runs or waits (or its lock is held), again
# every HOLD_BUSY_RETRY (1 s); an operation's end re-arms that timer 1 s on
# (controller._arm_hold, _hold_due, _run). An operation in flight at the
# hold's end delays it by what is left of that operation, each bounded by
# its own bound (a drain by the drain timeout and as long again of retries, a
# job by the agent's timeouts, a return's waits for the node and its GPUs:
# all within SETTLE_BOUND, which ``unsettled`` judges). So once its time is
# over and GPU Handoff is idle, a hold ends within HOLD_BUSY_RETRY, plus the
# event loop's lateness (LAG_LIMIT) and the sampling (HOLD_SAMPLE, twice).
HOLD_SAMPLE: Final = 0.05
HOLD_LATE: Final = HOLD_BUSY_RETRY.total_seconds() + DEFAULT_LAG_LIMIT + 2 * HOLD_SAMPLE

GPU: Final = "gpu-node"
GAMING: Final = ("gaming-1", "gaming-2")
SWITCHES: Final = {vm: f"switch.gaming_station_{vm[-1]}" for vm in GAMING}

# --- what a cycle may do ----------------------------------------------------------

# Requests: a switch on or off, both players starting or quitting, a VM
# started by hand on the tower (``virsh start``: libvirt runs the agent's
# hook), the return_cards action, the start_handoff action (waiting for its
# answer).
REQUESTS: Final = (
    "on",
    "off",
    "both_on",
    "both_off",
    "hand",
    "return_cards",
    "start_handoff",
)
REQUEST_WEIGHTS: Final = (20, 25, 8, 12, 10, 5, 20)
WITH_VM: Final = frozenset({"on", "off", "hand", "start_handoff"})
HANDOFF_REQUESTS: Final = frozenset({"on", "both_on", "hand", "start_handoff"})
# Prepare ahead (``HandoffController.async_prepare``): a share of the cycles
# (``PREPARE_ODDS``, drawn from a generator of their own: the other cycles of
# a seed draw what they drew before prepare existed) prepare a gaming VM with
# a hold of a few seconds (``HOLD_SECONDS``, at the soak's pace), and once the
# cards are held (or the prepare is over without a hold), after a drawn part
# of the hold (``FOLLOW_WITHIN``): turn that VM on (within the hold: it only
# starts), let the hold expire (the cards go back), turn the other gaming VM
# on, return the cards, or turn the held VM off.
PREPARE_REQUESTS: Final = (
    "prepare_on",
    "prepare_expire",
    "prepare_other_on",
    "prepare_return_cards",
    "prepare_off",
)
PREPARE_WEIGHTS: Final = (35, 25, 15, 10, 15)
PREPARE_ODDS: Final = 0.25
HOLD_SECONDS: Final = (2.0, 4.0)
FOLLOW_WITHIN: Final = (0.0, 0.5)  # the follow-up's delay, as a part of the hold
# Requests that start a gaming VM (a start failing after the hook means
# something only there).
STARTING_REQUESTS: Final = HANDOFF_REQUESTS | {"prepare_on", "prepare_other_on"}
HANDOFF_MOMENTS: Final = ("before", "draining", "job", "mid_job")
RETURN_MOMENTS: Final = ("before", "job", "mid_job", "node_return", "gpu_wait")
MOMENTS: Final = ("before", "draining", "job", "mid_job", "node_return", "gpu_wait")

FAULTS: Final = (
    "ssh_cut",  # the SSH connection dies (its sshd processes are killed)
    "agent_killed",  # the agent's session process is killed (TERM or KILL)
    "ha_reload",  # Home Assistant reloads the config entry
    "ha_restart",  # Home Assistant stops and starts again on the same storage
    "libvirt_down",  # libvirt unavailable for a while
    "guest_agent",  # a guest agent late or never up (the domain's next boot)
    "guest_shutdown",  # a guest shutdown slow, or ignored
    "pdb_refusing",  # the PodDisruptionBudget refuses for a while
    "eviction_error",  # evictions answered 500/503 or 504 (timed out)
    "api_down",  # the API server unreachable for a while
    "operator_cordon",  # an operator places or removes a cordon
    "unmanaged_pod",  # a pod nothing recreates appears on the GPU node
    "start_fails",  # a gaming VM's starts fail after the hook (disk, VFIO)
    "player_quits",  # a player shuts their VM down from inside while another plays
    "operator_stop",  # the operator shuts the GPU node down mid-drain
    "vm_removed",  # a gaming VM's subentry removed while the tower job runs
    "slow_graceful_stop",  # a graceful stop outlasts libvirt's agent-shutdown wait
    "guest_quits_racing_stop",  # the player shuts down as GPU Handoff's stop arrives
    "libvirtd_restart",  # libvirtd restarts: event streams end, virsh fails or waits
    "player_starts",  # another gaming VM's switch turned on while the GPUs come back
    "hand_start",  # a gaming VM started by hand on the tower while the GPUs come back
)
# Faults bound to one moment whatever the request: the operator's shutdown
# strikes while GPU Handoff drains, a removal while the tower job runs, a
# player starting (by the switch or by hand on the tower) while a return
# waits for the GPUs under GPU Handoff's cordon (a return's, or with lending
# the restart with the free cards after a handoff).
FIXED_MOMENTS: Final = {
    "operator_stop": "draining",
    "vm_removed": "mid_job",
    "player_starts": "gpu_wait",
    "hand_start": "gpu_wait",
}
# Faults that only mean something before the stop they change is sent: drawn
# among these moments (those the request's operation has).
EARLY_MOMENTS: Final = {
    "slow_graceful_stop": ("before", "draining", "job"),
    "guest_quits_racing_stop": ("before", "job"),
}
# Faults never drawn (empty: every fault of FAULTS is). A fault whose rig
# support is missing can be left out here for a while; empty, the plans are
# those of rng.sample(FAULTS, ...), so a replay line stays valid.
DISABLED_FAULTS: Final[frozenset[str]] = frozenset()
# The share of cycles whose agent shutdowns lose libvirt's race with QEMU's
# exit (Plan.socket_race).
SOCKET_RACE_ODDS: Final = 0.25
FAULT_COUNT_WEIGHTS: Final = (2, 4, 3, 2)  # 0, 1, 2 or 3 faults

# slow_graceful_stop: libvirt's wait in ``virsh shutdown --mode agent`` for
# the power-off (VIR_DOMAIN_QEMU_AGENT_COMMAND_SHUTDOWN, 60 s: then "Guest
# agent is not responding" although the guest goes on powering off), in real
# seconds at the rig's pace; the guest takes between 1.5 times that and 0.8
# times the agent's shutdown timeout (real seconds) to power off: libvirt
# refuses, the agent must wait for the power-off and succeed.
LIBVIRT_AGENT_WAIT: Final = sim_model.AGENT_SHUTDOWN_TIMEOUT * TIME_SCALE
SLOW_STOP: Final = (
    round(LIBVIRT_AGENT_WAIT * 1.5, 1),
    round(AGENT_TIMEOUTS["shutdown"] * 0.8, 1),
)
# libvirtd_restart: libvirtd is away this long (real seconds); once it is
# back, Home Assistant's entities of the tower must be available again within
# RECOVERY_BOUND (measured every RECOVERY_SAMPLE for up to RECOVERY_WINDOW).
LIBVIRTD_DOWN: Final = (0.3, 3.0)
RECOVERY_BOUND: Final = 2.0
RECOVERY_WINDOW: Final = 15.0
RECOVERY_SAMPLE: Final = 0.05
# The job failures of a graceful stop that a guest going down must not cause.
SHUTDOWN_FAILURES: Final = frozenset({"shutdown_refused", "shutdown_timeout"})
# libvirt away: any virsh call may fail, so may any stop.
LIBVIRT_OUTAGES: Final = frozenset({"libvirt_down", "libvirtd_restart"})
# Faults that take Home Assistant's agent session (or the entry) away by
# themselves: the entities' recovery after a libvirtd restart is measured in
# a cycle with one of these, and not held against the product.
SESSION_FAULTS: Final = frozenset(
    {"ssh_cut", "agent_killed", "ha_reload", "ha_restart", "libvirt_down", "vm_removed"}
)

# Faults that take the tower or the API server away for a while: a request
# that fails with a passing failure's code (report.TRANSIENT_CODES) must have
# met outages longer in all than the bound of its retries (the drain
# timeout). Each lasts its ``seconds`` (if it has them) and RECONNECT more:
# a new SSH connection and agent session, a new libvirt connection.
OUTAGES: Final = frozenset(
    {"ssh_cut", "agent_killed", "libvirt_down", "libvirtd_restart", "api_down"}
)
RECONNECT: Final = 2.0

# Failures the user must act on get a repair issue (operations.failed).
USER_ACTS: Final = frozenset(
    {
        "agent_timeout",
        "shutdown_refused",
        "shutdown_timeout",
        "devices_busy",
        "start_failed",
        "runner_died",
        "DrainError",
        "unmanaged_pods",
        "cordoned_by_operator",
        "node_not_ready",
    }
)
FORCED: Final = frozenset({"destroy", "reset"})

# The demo cluster's workloads on the GPU node (tests/k8semu/seed.py) that a
# ReplicaSet recreates: (ReplicaSet, its pods' labels).
WORKLOADS: Final = {
    "llm-inference-5d9c8b7f6": {
        "app": "llm-inference",
        "pod-template-hash": "5d9c8b7f6",
    },
    "trainer-7c6d5e4f3": {"app": "trainer", "pod-template-hash": "7c6d5e4f3"},
}
WORKLOAD_NS: Final = "ai"
PDB: Final = ("trainer", "ai")
# The soak's own workloads beside the demo cluster's, on the GPU node: a
# Deployment's ReplicaSet whose pods tolerate the cordon (its replacement
# comes back to the cordoned node at once, and the drain leaves it: the
# kubelet stand-in plays the ReplicaSet controller and the scheduler for
# it), and a DaemonSet's pod on the host network (as the seed's NVIDIA
# device plugin): a metrics exporter.
TOLERANT: Final = "metrics-relay-6f7d8c9b5"
TOLERANT_LABELS: Final = {"app": "metrics-relay", "pod-template-hash": "6f7d8c9b5"}
TOLERANT_IMAGE: Final = "registry.example/metrics-relay:2.4"
EXPORTER: Final = "node-exporter"
EXPORTER_LABELS: Final = {"app.kubernetes.io/name": "node-exporter"}
EXPORTER_IMAGE: Final = "quay.io/prometheus/node-exporter:v1.9.1"
MONITORING_NS: Final = "monitoring"
CORDON_TOLERATION: Final = {
    "key": UNSCHEDULABLE_TAINT["key"],
    "operator": "Exists",
    "effect": "NoSchedule",
}
# How the taint eviction controller marks the pods it deletes (a
# DisruptionTarget condition, then a graceful delete).
TAINT_MANAGER_REASON: Final = "DeletionByTaintManager"


# --- plans ------------------------------------------------------------------------


@dataclass(frozen=True)
class Fault:
    """One fault, the moment it strikes, and its parameters."""

    kind: str
    moment: str
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "moment": self.moment, **dict(self.params)}


@dataclass(frozen=True)
class Plan:
    """What one cycle does: a request and the faults that strike."""

    seed: int
    cycle: int
    request: str
    vm: str | None = None
    faults: tuple[Fault, ...] = ()
    # Every agent shutdown of this cycle loses libvirt's race with QEMU's
    # exit: "End of file from agent socket" as the guest powers off
    # (Tower.agent_sockets_close_first).
    socket_race: bool = False
    # A prepare (PREPARE_REQUESTS): how long the cards are held (seconds),
    # and how long after they are held its follow-up is sent.
    hold: float = 0.0
    then_after: float = 0.0

    @property
    def prepares(self) -> bool:
        return self.request in PREPARE_REQUESTS

    @property
    def follow_up(self) -> str:
        """What a prepare's cycle does once the cards are held: ``on``,
        ``expire``, ``other_on``, ``return_cards`` or ``off``."""
        return self.request.removeprefix("prepare_") if self.prepares else ""

    def as_json(self) -> dict[str, Any]:
        return {
            "cycle": self.cycle,
            "request": self.request,
            "vm": self.vm,
            "faults": [fault.as_json() for fault in self.faults],
            "socket_race": self.socket_race,
            **(
                {"hold_s": self.hold, "then_after_s": self.then_after}
                if self.prepares
                else {}
            ),
        }


def _fault(rng: random.Random, kind: str, moment: str, vm: str | None) -> Fault:
    params: dict[str, Any] = {}
    if kind == "agent_killed":
        params["signal"] = rng.choice(("TERM", "KILL"))
    elif kind == "ha_restart":
        params["down"] = round(rng.uniform(0.0, 1.0), 1)
    elif kind == "libvirt_down":
        params["seconds"] = round(rng.uniform(0.5, 4.0), 1)
    elif kind in ("guest_agent", "guest_shutdown"):
        params["target"] = rng.choice((GPU, vm or rng.choice(GAMING)))
        params["mode"] = rng.choice(
            ("late", "never") if kind == "guest_agent" else ("slow", "ignored")
        )
        params["seconds"] = round(rng.uniform(1.0, 2.5), 1)
    elif kind == "pdb_refusing":
        params["seconds"] = round(rng.uniform(1.0, 12.0), 1)
    elif kind == "eviction_error":
        params["count"] = rng.randint(1, 3)
        params["status"] = rng.choice((500, 503, 504))
    elif kind == "api_down":
        params["seconds"] = round(rng.uniform(1.0, 6.0), 1)
    elif kind == "operator_cordon":
        params["action"] = rng.choice(("place", "remove"))
    elif kind == "start_fails":
        params["target"] = vm or rng.choice(GAMING)
        params["reason"] = rng.choice(("disk", "vfio"))
    elif kind in ("player_quits", "player_starts", "hand_start"):
        # The other player: the request's VM is the one that goes on (or is
        # handed its cards meanwhile), or whose stop ended; the other one
        # quits, or starts playing while the cards go back.
        params["target"] = (
            next(other for other in GAMING if other != vm) if vm else rng.choice(GAMING)
        )
    elif kind == "vm_removed":
        params["target"] = vm or rng.choice(GAMING)
    elif kind == "slow_graceful_stop":
        # The GPU node (a handoff stops it) or the cycle's gaming VM (a stop
        # of it, this cycle or the next).
        params["target"] = rng.choice((GPU, vm or rng.choice(GAMING)))
        params["seconds"] = round(rng.uniform(*SLOW_STOP), 1)
    elif kind == "guest_quits_racing_stop":
        # Only a stop of a gaming VM races: "off" (its VM), "both_off" (one
        # of the two); with any other request it does nothing.
        params["target"] = vm or rng.choice(GAMING)
    elif kind == "libvirtd_restart":
        params["seconds"] = round(rng.uniform(*LIBVIRTD_DOWN), 1)
        params["socket_activated"] = rng.random() < 0.5
    return Fault(kind, FIXED_MOMENTS.get(kind, moment), tuple(sorted(params.items())))


def mirror(plan: Plan) -> Plan:
    """``plan`` with the two gaming VMs swapped (its VM, its faults' targets)."""
    swap = dict(zip(GAMING, reversed(GAMING), strict=True))
    return dataclasses.replace(
        plan,
        vm=swap.get(plan.vm, plan.vm) if plan.vm is not None else None,
        faults=tuple(
            Fault(
                fault.kind,
                fault.moment,
                tuple(
                    (key, swap.get(value, value) if key == "target" else value)
                    for key, value in fault.params
                ),
            )
            for fault in plan.faults
        ),
    )


def _draw_moment(rng: random.Random, kind: str, moments: tuple[str, ...]) -> str:
    early = EARLY_MOMENTS.get(kind)
    if early is None:
        return rng.choice(moments)
    return rng.choice([moment for moment in moments if moment in early])


def _draw_faults(
    rng: random.Random,
    moments: tuple[str, ...],
    vm: str | None,
    starts: str | None = None,
) -> tuple[Fault, ...]:
    """0-3 faults of distinct kinds, each at one of ``moments`` (``starts``:
    the gaming VM the cycle starts, the target of ``start_fails``, if not
    ``vm``)."""
    count = rng.choices(range(len(FAULT_COUNT_WEIGHTS)), FAULT_COUNT_WEIGHTS)[0]
    kinds = rng.sample([kind for kind in FAULTS if kind not in DISABLED_FAULTS], count)
    return tuple(
        _fault(
            rng,
            kind,
            _draw_moment(rng, kind, moments),
            starts if kind == "start_fails" and starts else vm,
        )
        for kind in kinds
    )


def plan_cycle(seed: int, cycle: int) -> Plan:
    """The request and faults of ``cycle``, from the seed and the cycle alone."""
    rng = random.Random(f"gpu-handoff-chaos:{seed}:{cycle}")  # noqa: S311
    request = rng.choices(REQUESTS, weights=REQUEST_WEIGHTS)[0]
    vm = rng.choice(GAMING) if request in WITH_VM else None
    moments = HANDOFF_MOMENTS if request in HANDOFF_REQUESTS else RETURN_MOMENTS
    faults = _draw_faults(rng, moments, vm)
    # Drawn apart, so the requests and faults of a seed stay those that were
    # drawn before it existed (the regression seeds replay what they found).
    race = random.Random(f"gpu-handoff-chaos:{seed}:{cycle}:socket")  # noqa: S311
    socket_race = race.random() < SOCKET_RACE_ODDS
    # Prepare ahead, drawn apart too: a cycle it does not take is the cycle
    # it was before prepare joined the alphabet.
    prepare = random.Random(f"gpu-handoff-chaos:{seed}:{cycle}:prepare")  # noqa: S311
    if prepare.random() < PREPARE_ODDS:
        return _prepare_plan(prepare, seed, cycle, socket_race)
    return Plan(seed, cycle, request, vm, faults, socket_race)


def _prepare_plan(rng: random.Random, seed: int, cycle: int, socket_race: bool) -> Plan:
    """A prepare's cycle: a gaming VM prepared with a hold of a few seconds,
    then its follow-up. Its operations (the prepare's drain and stop of the
    GPU node; then a start, a stop, or a return after the hold ends, or with
    lending the GPU node's restart with the free cards but the held VM's)
    reach every moment."""
    request = rng.choices(PREPARE_REQUESTS, weights=PREPARE_WEIGHTS)[0]
    vm = rng.choice(GAMING)
    hold = round(rng.uniform(*HOLD_SECONDS), 1)
    then_after = round(hold * rng.uniform(*FOLLOW_WITHIN), 1)
    if request == "prepare_expire":
        then_after = 0.0
    other = next(name for name in GAMING if name != vm)
    starts = other if request == "prepare_other_on" else vm
    faults = _draw_faults(rng, MOMENTS, vm, starts)
    return Plan(seed, cycle, request, vm, faults, socket_race, hold, then_after)


def cleared_by_ping(
    data: dict[str, Any], answered: list[float], domain: str, at: float
) -> bool:
    """Whether one of ``domain``'s answered guest-pings (when each ended, in
    order) ended within PING_TO_SHUTDOWN before a shutdown sent at ``at``,
    with its guest agent connected then, in the boot it is in at ``at`` (see
    ``stop_before_guest_agent``)."""
    now = sim_model.world(data, at=at).doms.get(domain)
    for ended in reversed(answered):
        if ended > at:
            continue
        if at - ended > PING_TO_SHUTDOWN:
            return False
        then = sim_model.world(data, at=ended).doms.get(domain)
        return (
            now is not None
            and then is not None
            and then.agent_connected
            and then.boot_t == now.boot_t
        )
    return False


# --- results ------------------------------------------------------------------------


def replay_command(seed: int, cycle: int, *, lend: bool = False) -> str:
    """The command that replays cycles 1..``cycle`` of ``seed`` with every
    option of the run (lending; a loop lag limit other than the default)."""
    words = ["scripts/chaos"]
    if lend:
        words.append("--lend")
    words += ["--cycles", str(cycle), "--seed", str(seed)]
    limit = os.environ.get("GPU_HANDOFF_CHAOS_LAG_LIMIT")
    if limit is not None and float(limit) != DEFAULT_LAG_LIMIT:
        words.insert(0, f"GPU_HANDOFF_CHAOS_LAG_LIMIT={shlex.quote(limit)}")
    return " ".join(words)


@dataclass(frozen=True)
class Violation:
    """An invariant that did not hold, and how to replay it."""

    seed: int
    cycle: int
    invariant: str
    detail: str
    lend: bool = False
    # The cycle's request and faults as planned (what the replay replays).
    request: str = ""
    faults: tuple[Fault, ...] = ()

    @property
    def replay(self) -> str:
        return replay_command(self.seed, self.cycle, lend=self.lend)

    def as_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "cycle": self.cycle,
            "invariant": self.invariant,
            "detail": self.detail,
            "request": self.request,
            "faults": [fault.as_json() for fault in self.faults],
            "replay": self.replay,
        }


@dataclass
class Ask:
    """One request of a cycle as it was sent, and what became of it."""

    vm: str  # the gaming VM, or the GPU node for return_cards
    want: str  # on | off | return
    how: str  # the request kind
    status: str = "pending"  # accepted | refused | unavailable | cancelled | ...
    detail: str = ""
    response: Any = None
    sent_at: float | None = None  # epoch seconds: when it was sent (None: never)
    removed: bool = False  # its gaming VM was removed from GPU Handoff meanwhile


@dataclass
class Seen:
    """An event of Home Assistant's bus during a cycle."""

    at: float
    type: str
    data: dict[str, Any]
    epoch: float = 0.0


@dataclass(frozen=True)
class Returned:
    """The GPU node's Kubernetes node at the instant a ``cards_returned``
    event fired."""

    cycle: int
    epoch: float
    boot_id: str | None
    ready: bool


@dataclass
class OperatorStop:
    """The operator shut the GPU node down (``operator_stop``): GPU Handoff
    may not start it again until a request asks for the cards back."""

    cycle: int
    at: float  # epoch seconds
    # A request of the same cycle, sent before the stop, asked for the cards
    # back (the stop came while GPU Handoff returned them): a start within
    # that cycle is not held against it.
    excused: bool = False
    ended: float | None = None  # epoch: the cards asked for back, or started by hand
    why_ended: str = ""


@dataclass
class SlowStop:
    """A graceful stop of ``target`` slower than libvirt's agent-shutdown
    wait and within the agent's shutdown timeout (``slow_graceful_stop``, or
    ``guest_shutdown`` slow within that timeout): a stop of it must not fail."""

    target: str
    seconds: float  # real seconds from the shutdown to the power-off
    since: float  # epoch: the duration is in effect from here
    cycle: int


@dataclass
class RaceStop:
    """The player of ``target`` shuts it down from inside at the instant the
    next ``virsh shutdown`` of it arrives (``guest_quits_racing_stop``)."""

    target: str
    cycle: int
    armed: float  # epoch
    consumed: bool = False  # a shutdown came: the race happened


@dataclass
class LibvirtdRestart:
    """A restart of libvirtd (``libvirtd_restart``) and what Home Assistant's
    entities of the tower did around it."""

    cycle: int
    seconds: float  # away this long (real seconds)
    socket_activated: bool
    began: float = 0.0  # monotonic
    back: float = 0.0  # monotonic: libvirtd answers again
    went_unavailable: list[str] = field(default_factory=list)  # while it was away
    # Seconds after ``back`` until every entity was available (None: not
    # within RECOVERY_WINDOW), and those still unavailable then.
    available_after: float | None = None
    still_unavailable: list[str] = field(default_factory=list)
    excused: str = ""  # a fault of the cycle that takes the session away

    def as_json(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "socket_activated": self.socket_activated,
            "went_unavailable": self.went_unavailable,
            "available_after_s": None
            if self.available_after is None
            else round(self.available_after, 2),
            "still_unavailable": self.still_unavailable,
            "excused": self.excused,
        }


@dataclass
class HoldSeen:
    """Cards held for a gaming VM after a prepare (the controller's
    ``state.hold``), from the instant it was set to the instant it was
    cleared (the harness traces every change of it: ``_trace_hold``), and
    GPU Handoff busy or idle meanwhile, sampled every HOLD_SAMPLE."""

    vm: str
    until_text: str  # Hold.until as the controller has it (ISO 8601, UTC)
    until: float  # epoch: the hold's time is over
    began: float  # epoch
    cycle: int
    ended: float | None = None  # epoch
    # Why it ended: expired, plays, gone (core.HoldEnd), "<kind> of <vm>"
    # (an operation began: core.hold_after), replaced, not kept...
    why: str = ""
    # (epoch, busy): GPU Handoff had an operation running or waiting, its
    # lock held, or the entry not loaded, while the hold lasted.
    samples: list[tuple[float, bool]] = field(default_factory=list)
    # The world was judged up to here (held_card_taken), once per cycle.
    checked_until: float = 0.0
    reported: bool = False  # hold_outlived reported already
    judged: bool = False  # ended, and judged (hold_outlived, cards back)

    @property
    def unused(self) -> bool:
        """Ended as the product ends a hold nobody used (core.reconcile: the
        cards go back as at a session's end): its time over, or its VM no
        longer GPU Handoff's."""
        return self.why in ("expired", "gone")

    def as_json(self) -> dict[str, Any]:
        return {
            "vm": self.vm,
            "until": _stamp(self.until),
            "ended": _stamp(self.ended) if self.ended is not None else None,
            "why": self.why,
            "late_s": round(self.ended - self.until, 2)
            if self.ended is not None
            else None,
        }


def hold_overstay(hold: HoldSeen, now: float) -> float:
    """How long ``hold`` outlived its time while GPU Handoff was idle without
    a break (seconds; 0 if never): over each run of idle samples with the
    hold still there, from the later of its first sample and the hold's
    ``until`` to its last sample (the end of a run is known to a sample's
    period; the shorter reading is taken)."""
    end = hold.ended if hold.ended is not None else now
    worst = 0.0
    first: float | None = None
    last = 0.0
    for at, busy in [*hold.samples, (end, True)]:
        if busy or at >= end:
            if first is not None:
                worst = max(worst, last - max(first, hold.until))
            first = None
            if at >= end:
                break
            continue
        if first is None:
            first = at
        last = at
    return max(0.0, worst)


_TRACED_STATES: dict[type, type] = {}


def _trace_hold(state: Any, changed: Callable[[Any, Any], None]) -> None:
    """Have ``changed(old, new)`` called at every change of ``state.hold``
    (the controller's OwnedState), synchronously where the product sets it
    (``core.hold_after`` as an operation begins, ``Operations._hold`` as a
    prepare ends, ``_reconcile`` as a hold ends): the instance's class is
    swapped for a subclass whose ``hold`` is a property over the same
    instance attribute. Nothing else of the state changes."""
    base = type(state)
    if getattr(base, "_chaos_traced", False):
        base = base.__mro__[1]
    traced = _TRACED_STATES.get(base)
    if traced is None:

        def get(obj: Any) -> Any:
            return obj.__dict__.get("hold")

        def put(obj: Any, value: Any) -> None:
            old = obj.__dict__.get("hold")
            obj.__dict__["hold"] = value
            notify = obj.__dict__.get("_chaos_hold_changed")
            if notify is not None and value != old:
                notify(old, value)

        traced = type(
            f"Traced{base.__name__}",
            (base,),
            {"hold": property(get, put), "_chaos_traced": True},
        )
        _TRACED_STATES[base] = traced
    state.__class__ = traced
    state.__dict__["_chaos_hold_changed"] = changed


class InapplicableError(Exception):
    """A fault whose precondition does not hold at its moment (no second
    player, a GPU node already off, a VM already removed): it does nothing."""


@dataclass
class Proc:
    """A process of the rig, from /proc."""

    pid: int
    ppid: int
    age: float
    argv: list[str]
    command: str | None  # SSH_ORIGINAL_COMMAND: what a forced agent runs

    @property
    def verb(self) -> str:
        return (self.command or "").split(" ", 1)[0]


class LoopLag:
    """How late Home Assistant's event loop wakes a task sleeping 10 ms at a
    time (as in tests/bench), and how much of that lateness is its own.

    A machine whose cores are all busy (two test workers, a build beside
    the soak) wakes every sleeper late; code that holds the event loop
    wakes only the loop's. So a thread of the harness, the canary, sleeps
    the same 10 ms at a time, and a loop sample's own lateness is its lag
    less the worst lag of the canary's sleeps that overlap it. The canary
    runs whenever the loop thread waits in a system call or computes in
    Python (the interpreter hands the GIL over every 5 ms); only a C call
    that keeps the GIL for long holds it too, and that hides behind the
    machine's load as well.
    """

    PERIOD = 0.01

    def __init__(self) -> None:
        # (when the sleep began, how late it woke), in order
        self.samples: list[tuple[float, float]] = []
        self.canary: list[tuple[float, float]] = []
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._halt = threading.Event()

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name="chaos loop lag"
        )
        self._halt.clear()
        self._thread = threading.Thread(
            target=self._canary, name="chaos loop lag canary", daemon=True
        )
        self._thread.start()

    async def _run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.PERIOD)
            self.samples.append(
                (before, max(0.0, time.monotonic() - before - self.PERIOD))
            )

    def _canary(self) -> None:
        while not self._halt.is_set():
            before = time.monotonic()
            time.sleep(self.PERIOD)
            self.canary.append(
                (before, max(0.0, time.monotonic() - before - self.PERIOD))
            )

    def take(self) -> tuple[float, float]:
        """The largest lag since the last take, and the largest part of a
        lag that was the loop's own (see own_lags)."""
        samples, self.samples = self.samples, []
        canary, self.canary = self.canary, []
        own = own_lags(samples, canary, self.PERIOD)
        return max((lag for _, lag in samples), default=0.0), max(own, default=0.0)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._halt.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None


def own_lags(
    samples: list[tuple[float, float]],
    canary: list[tuple[float, float]],
    period: float,
) -> list[float]:
    """Each loop sample's lag less the worst lag of the canary's sleeps that
    overlap it (began before it woke, woke after it began). Samples are
    (began, lag), each list in order. A sample no canary sleep overlaps
    (the canary was not running) keeps its whole lag."""
    own: list[float] = []
    first = 0
    for began, lag in samples:
        woke = began + period + lag
        while first < len(canary) and sum(canary[first]) + period <= began:
            first += 1  # woke before this sample began
        load = 0.0
        for c_began, c_lag in canary[first:]:
            if c_began >= woke:
                break
            load = max(load, c_lag)
        own.append(max(0.0, lag - load))
    return own


# --- the API server's reachability ----------------------------------------------------


class ApiProxy:
    """A TCP proxy in front of the emulator: while ``down``, every connection
    through it is cut and new ones are closed at once (TLS passes through)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.down = False
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])

    def _track(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        if self.down:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(
                "127.0.0.1", self.upstream_port
            )
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        self._track(self._pipe(reader, up_writer))
        self._track(self._pipe(up_reader, writer))

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except OSError, asyncio.IncompleteReadError:
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    def set_down(self, down: bool) -> None:
        self.down = down
        if down:
            for writer in list(self._writers):
                writer.transport.abort()
            self._writers.clear()

    async def close(self) -> None:
        self.set_down(True)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


# --- processes ------------------------------------------------------------------------


def _proc_table(marker: str) -> list[Proc]:
    """Live processes whose command line mentions ``marker`` (the rig's
    directory: its agent configuration, simulator and units)."""
    clock = os.sysconf("SC_CLK_TCK")
    try:
        uptime = float(Path("/proc/uptime").read_text(encoding="utf-8").split()[0])
    except OSError:
        uptime = 0.0
    found: list[Proc] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = entry.joinpath("cmdline").read_bytes().split(b"\0")
            text = [part.decode(errors="replace") for part in argv if part]
            if not any(marker in part for part in text):
                continue
            stat = entry.joinpath("stat").read_text(encoding="utf-8")
            fields = stat.rsplit(")", 1)[1].split()
            if fields[0] == "Z":
                continue
            environ = entry.joinpath("environ").read_bytes().split(b"\0")
        except OSError:
            continue
        command = next(
            (
                item.split(b"=", 1)[1].decode(errors="replace")
                for item in environ
                if item.startswith(b"SSH_ORIGINAL_COMMAND=")
            ),
            None,
        )
        found.append(
            Proc(
                pid=int(entry.name),
                ppid=int(fields[1]),
                age=uptime - int(fields[19]) / clock,
                argv=text,
                command=command,
            )
        )
    return found


def _children() -> dict[int, list[int]]:
    table: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text(encoding="utf-8").rsplit(")", 1)[1].split()
        except OSError:
            continue
        table.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    return table


def _descendants(pid: int) -> list[int]:
    children = _children()
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8").strip()
    except OSError:
        return ""


def _epoch(stamp: str) -> float:
    """An agent timestamp (``2026-12-01T02:10:34.318Z``) as epoch seconds."""
    return dt.datetime.fromisoformat(stamp).timestamp()


def _stamp(epoch: float) -> str:
    """Epoch seconds as the agent writes its times (UTC, milliseconds)."""
    moment = dt.datetime.fromtimestamp(float(epoch), dt.UTC)
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 1000:03d}"


def _superseded(ask: Ask, asks: list[Ask]) -> bool:
    """Whether a request sent later in the cycle wants otherwise: the same
    VM the other way (a player starts again the VM just turned off, by the
    switch or by hand), or a gaming VM on after a ``return_cards`` (its
    handoff takes the cards the return gave back). A prepare neither is
    overridden (its part is done once the cards are held: what comes after
    it is the follow-up's, judged on its own) nor overrides (it leaves the
    VM off)."""
    if ask.sent_at is None or ask.want == "prepare":
        return False
    return any(
        later.sent_at is not None
        and later.sent_at > ask.sent_at
        and later.status in ("accepted", "cancelled")
        and (
            (later.vm == ask.vm and later.want not in (ask.want, "prepare"))
            or (ask.want == "return" and later.want == "on")
        )
        for later in asks
    )


# An instant the GPU node ran, and the cards it ran with.
Run = tuple[float, set[str]]


def _cards(addresses: list[str]) -> set[str]:
    """The cards of PCI functions (``0000:03:00.1`` -> ``0000:03:00``)."""
    return {address.rsplit(".", 1)[0] for address in addresses}


def _lock_free(path: Path) -> bool:
    try:
        handle = path.open("a+", encoding="utf-8")
    except OSError:
        return True
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
        return True


# --- the rig ------------------------------------------------------------------------


VIRSH_WRAPPER = """#!/bin/sh
# libvirt for the chaos soak: unavailable while {down} exists.
if [ -e {down} ]; then
  echo "error: failed to connect to the hypervisor" >&2
  echo "error: Failed to connect socket to '/run/libvirt/virtqemud-sock': Connection refused" >&2
  exit 1
fi
exec {virsh} "$@"
"""


@dataclass
class CycleRecord:
    """One cycle as it went, for the summary."""

    plan: Plan
    seconds: float = 0.0
    lag_max: float = 0.0
    lag_own: float = 0.0  # the part of a lag a thread beside the loop had not
    outcome: str = ""
    fired: list[str] = field(default_factory=list)
    unreached: list[str] = field(default_factory=list)
    inapplicable: list[str] = field(default_factory=list)
    asks: list[Ask] = field(default_factory=list)
    # What the faults did, counted (a slow stop libvirt gave up on and the
    # agent saw through, a race that happened, a reconnect hook run...).
    observed: Counter[str] = field(default_factory=Counter)
    restarts: list[LibvirtdRestart] = field(default_factory=list)
    holds: list[HoldSeen] = field(default_factory=list)  # begun this cycle


class ChaosRig:
    """The whole product, its faults and its invariants, for one run."""

    def __init__(
        self,
        hass: HomeAssistant,
        cluster: K8sEmulator,
        root: Path,
        *,
        seed: int,
        agent: Path = AGENT,
        settle_bound: float = SETTLE_BOUND,
        cordon_bound: float = CORDON_NET_BOUND,
        recover: bool = True,
        log: Callable[[str], None] | None = None,
        lend: bool = False,
        plugin_after: tuple[float, float] = DEVICE_PLUGIN_AFTER,
    ) -> None:
        self.hass = hass
        self.lend = lend
        self.plugin_after = plugin_after
        self.recover = recover
        self.cordon_bound = cordon_bound
        self.cluster = cluster
        self.root = root
        self.seed = seed
        self.agent = agent
        self.settle_bound = settle_bound
        self.log = log or (lambda text: None)
        self.sim: Tower
        self.sshd: Sshd
        self.proxy: ApiProxy
        self.entry: MockConfigEntry
        self.config: Path
        self.state_dir: Path
        self.down_flag = root / "libvirt-down"
        self.cycle = 0
        self.violations: list[Violation] = []
        self.records: list[CycleRecord] = []
        self.lag = LoopLag()
        self._unsubscribe: list[Callable[[], None]] = []
        self._kubelet: asyncio.Task[None] | None = None
        self._instrumented: object = None
        self._pending: dict[str, list[Fault]] = {}
        self._fired: list[str] = []
        self._fault_tasks: list[asyncio.Task[None]] = []
        self._request_tasks: list[asyncio.Task[None]] = []
        self._events: list[Seen] = []
        self._restarts: list[float] = []
        self._restart_lock = asyncio.Lock()
        self._restores: list[tuple[int, str, str, Any]] = []
        self.operator_cordon = False
        self._harness_writing = False
        self._harness_removed: set[str] = set()
        self._unmanaged: set[tuple[str, str]] = set()
        self._left: list[tuple[int, str, str, str, str]] = []
        self._lifts: list[tuple[int, float]] = []  # (cycle, epoch): our cordon lifted
        self._requests_seen = 0
        self._accepted_evictions: set[tuple[str, str]] = set()
        self._commands_offset = 0
        # the guest-pings read that have not ended yet: their domain, by id
        self._pings: dict[str, str] = {}
        # each domain's answered guest-pings: when they ended
        self._answered: dict[str, list[float]] = {}
        self._jobs: dict[str, dict[str, Any]] = {}
        self._listener_errors: list[str] = []
        self._pod_counter = 0
        self.kubelet: Kubelet | None = None
        self._inapplicable: list[str] = []
        self._asks_sent: list[Ask] = []
        self._cycle_began = 0.0  # epoch
        # The GPU node's bootIDs as the API server stored them: (epoch, bootID).
        self._boots: list[tuple[float, str | None]] = []
        self._returned: list[Returned] = []
        self._actions_seen = 0  # the simulator's actions read so far
        self._edges: list[tuple[float, str]] = []  # (epoch, what): cards asked back
        self._operator_stops: list[OperatorStop] = []
        self._starts_checked: set[tuple[str, int]] = set()  # (job id, step index)
        self._armed: set[str] = set()  # gaming VMs whose next start fails
        self._removed: dict[str, dict[str, Any]] = {}  # vm -> its subentry's fields
        self._failure_on_report = False
        self._slow_stops: dict[str, SlowStop] = {}  # target -> its slow stop
        self._slow_checked: set[tuple[str, int]] = set()  # (job id, step index)
        self._races: list[RaceStop] = []
        # The gaming VMs whose player quit from inside (player_quits): the
        # cycle is not over until they are off (_quitting).
        self._quits: set[str] = set()
        self._hook_runs_seen = 0  # the simulator's hook runs read so far
        # Pods the cluster itself deleted (the taint eviction controller), by
        # uid, and how many this cycle; where the last drain's requests begin
        # in the emulator's record; the pods a drain left this cycle.
        self._cluster_deleted: set[str] = set()
        self._taint_deleted = 0
        self._drain_from = 0
        self._came_back = 0
        # Returns this cycle that waited for the node, and for its GPUs.
        self._node_waits = 0
        self._gpu_waits = 0
        # Cards held for a gaming VM (a prepare): every hold seen, the one
        # that lasts now, and the task sampling GPU Handoff meanwhile.
        self._holds: list[HoldSeen] = []
        self._hold_open: HoldSeen | None = None
        self._hold_watch: asyncio.Task[None] | None = None

    # --- life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Tower, agent, sshd, proxy, kubelet, the entry; the first settle."""
        self.root.mkdir(parents=True, exist_ok=True)
        self.sim = await asyncio.to_thread(
            realistic_tower, self.root / "sim", time_scale=TIME_SCALE
        )
        virsh = self.root / "virsh"
        virsh.write_text(
            VIRSH_WRAPPER.format(
                down=shlex.quote(str(self.down_flag)),
                virsh=shlex.quote(str(self.sim.virsh)),
            ),
            encoding="utf-8",
        )
        virsh.chmod(0o755)
        self.config = write_agent_config(
            self.sim, self.root / "agent", **AGENT_TIMEOUTS
        )
        data = json.loads(self.config.read_text(encoding="utf-8"))
        data["commands"]["virsh"] = str(virsh)
        self.config.write_text(json.dumps(data), encoding="utf-8")
        self.state_dir = Path(data["state_dir"])
        command = [sys.executable, "-S", str(self.agent), "--config", str(self.config)]
        # libvirt's qemu hook is the rig's agent too (a broken copy under test
        # is broken there as well), through the script its install writes.
        await asyncio.to_thread(
            install_hook, self.sim, self.root / "agent", self.agent, self.config
        )
        self.sshd = await asyncio.to_thread(
            Sshd(self.root / "sshd", [*command, "serve"]).start
        )
        self.proxy = ApiProxy(self.cluster.port)
        await self.proxy.start()
        self._boots.append((time.time(), self._boot_id()))
        self.cluster.store.listeners.append(self._on_store)
        self._set_pdb(min_available=0)
        self._add_own_workloads()
        self.lag.start()
        self._kubelet = asyncio.get_running_loop().create_task(
            self._follow_gpu_node(), name="chaos kubelet"
        )
        self._hold_watch = asyncio.get_running_loop().create_task(
            self._watch_holds(), name="chaos holds"
        )
        for event in (
            EVENT_HANDOFF_STARTED,
            EVENT_HANDOFF_STEP,
            EVENT_HANDOFF_SUCCEEDED,
            EVENT_HANDOFF_FAILED,
            EVENT_CARDS_RETURNED,
            EVENT_RETURN_UNHEALTHY,
            EVENT_PREPARE_SUCCEEDED,
            EVENT_HOLD_EXPIRED,
        ):
            self._unsubscribe.append(self.hass.bus.async_listen(event, self._on_event))
        self.entry = self._add_entry()
        assert await self.hass.config_entries.async_setup(self.entry.entry_id)
        await self.hass.async_block_till_done()
        self._instrument()

    def _add_own_workloads(self) -> None:
        """The soak's workloads beside the demo cluster's on the GPU node: a
        pod of a Deployment's ReplicaSet tolerating the cordon, and a
        DaemonSet's pod on the host network (fixed names: nothing drawn)."""
        tolerant = self.cluster.add_replicaset(
            TOLERANT, MONITORING_NS, labels=TOLERANT_LABELS, image=TOLERANT_IMAGE
        )
        exporter = self.cluster.add_daemonset(
            EXPORTER, MONITORING_NS, labels=EXPORTER_LABELS, image=EXPORTER_IMAGE
        )
        exporter_labels = {**EXPORTER_LABELS, "controller-revision-hash": "7d4c9f8b6"}
        for owner, suffix, labels, image, spec in (
            (
                tolerant,
                "r2t4k",
                TOLERANT_LABELS,
                TOLERANT_IMAGE,
                {"tolerations": [dict(CORDON_TOLERATION)]},
            ),
            (
                exporter,
                "5kq8d",
                exporter_labels,
                EXPORTER_IMAGE,
                {"host_network": True},
            ),
        ):
            self._add_gpu_node_pod(
                f"{owner['metadata']['name']}-{suffix}",
                labels,
                owner,
                image=image,
                **spec,
            )

    def _add_gpu_node_pod(
        self, name: str, labels: dict[str, str], owner: dict[str, Any], **spec: Any
    ) -> None:
        """A running pod on the GPU node, in its owner's namespace."""
        self.cluster.add_pod(
            name,
            owner["metadata"]["namespace"],
            node=GPU_NODE,
            labels=labels,
            owner=self.cluster.owner_ref(owner),
            **spec,
        )

    def _add_entry(self) -> MockConfigEntry:
        kubeconfig = self.cluster.kubeconfig()
        kubeconfig["clusters"][0]["cluster"]["server"] = (
            f"https://127.0.0.1:{self.proxy.port}"
        )
        entry = MockConfigEntry(
            domain=DOMAIN,
            title="tower",
            unique_id=f"127.0.0.1:{self.sshd.port}",
            data=tower_entry_data(self.sshd)
            | {CONF_KUBECONFIG: yaml.safe_dump(kubeconfig, sort_keys=False)},
            options={
                CONF_SCAN_INTERVAL: SCAN_INTERVAL,
                CONF_DRAIN_TIMEOUT: DRAIN_TIMEOUT,
                CONF_AUTO_RETURN: True,
                CONF_LEND_FREE_CARDS: self.lend,
            },
            subentries_data=gaming_subentries(1, 2),
        )
        entry.add_to_hass(self.hass)
        return entry

    async def close(self) -> None:
        """Stop everything this rig started (the emulator is the fixture's)."""
        for task in [*self._fault_tasks, *self._request_tasks]:
            task.cancel()
        await asyncio.gather(
            *self._fault_tasks, *self._request_tasks, return_exceptions=True
        )
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        with contextlib.suppress(Exception):
            if self.entry.state is ConfigEntryState.LOADED:
                await self.hass.config_entries.async_unload(self.entry.entry_id)
                await self.hass.async_block_till_done()
        for task in (self._kubelet, self._hold_watch):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.lag.stop()
        with contextlib.suppress(ValueError):
            self.cluster.store.listeners.remove(self._on_store)
        await self.proxy.close()
        await asyncio.to_thread(self.sshd.stop)
        self.down_flag.unlink(missing_ok=True)
        await asyncio.to_thread(self.sim.close)
        await asyncio.to_thread(self._kill_rig_processes)

    def _kill_rig_processes(self) -> None:
        """Whatever of the rig still runs (an agent a fault orphaned)."""
        _signal([p.pid for p in _proc_table(str(self.root))], signal.SIGKILL)

    # --- observation: the bus, the store, the GPU node ------------------------------------

    @callback
    def _on_event(self, event: Event) -> None:
        data = dict(event.data)
        now = time.time()
        self._events.append(Seen(time.monotonic(), event.event_type, data, now))
        if event.event_type == EVENT_CARDS_RETURNED:
            # The node as the API server has it at this instant (in process).
            self._returned.append(
                Returned(self.cycle, now, self._boot_id(), self._node_ready())
            )
        if event.event_type == EVENT_HOLD_EXPIRED:
            self._hold_expired(str(data.get("vm")), str(data.get("hold_ends")), now)
        if event.event_type == EVENT_HANDOFF_STEP:
            step = str(data.get("step") or "")
            if step == "draining":
                self._drain_from = len(self.cluster.requests)
                self._moment("draining")
            elif step == "waiting_for_node":
                self._node_waits += 1
                self._moment("node_return")
            elif step == "waiting_for_gpus":
                self._gpu_waits += 1
                self._moment("gpu_wait")
            elif step not in ("uncordoning", STEP_RETRYING):
                # (Waiting to try again after a passing failure is no
                # moment of a job: none may be running.)
                self._moment("mid_job")
        if data.get("pods_came_back"):
            self._check_came_back(event.event_type, data)

    def _check_came_back(self, event_type: str, data: dict[str, Any]) -> None:
        """``came_back_evicted``: a pod that came back to the cordoned GPU
        node tolerating its cordon, which the drain left (the event's
        ``pods_came_back``), was never the object of an eviction request of
        that drain (the API server's record since its ``draining`` step)."""
        labels = [str(label) for label in data.get("pods_came_back") or []]
        self._came_back += len(labels)
        evictions = [
            request
            for request in self.cluster.requests[self._drain_from :]
            if request.resource == "pods/eviction"
        ]
        for label in labels:
            namespace, _, name = label.partition("/")
            answers = [
                request.status
                for request in evictions
                if (request.namespace, request.name) == (namespace, name)
            ]
            if answers:
                self._violate(
                    "came_back_evicted",
                    f"{label} came back to the cordoned GPU node tolerating its "
                    f"cordon and was left ({event_type} of {data.get('vm')}), yet "
                    f"the drain asked to evict it (answered {answers})",
                )

    def _instrument(self) -> None:
        """Know the moment a tower job's request id is stored, before it is
        asked for (the controller's ``save_job``, wrapped on the instance)."""
        if self.entry.state is not ConfigEntryState.LOADED:
            return
        controller = self.entry.runtime_data.controller
        if controller is self._instrumented:
            return
        self._instrumented = controller
        original = controller.progress.save_job

        async def save_job(job: Any) -> None:
            await original(job)
            if job is not None and job.job_id is None:
                self._moment("job")

        controller.progress.save_job = save_job  # type: ignore[method-assign]

        # Every change of the cards held for a gaming VM, at its instant, and
        # why a hold ended when the controller's reconcile ends it.
        _trace_hold(controller.state, self._hold_changed)
        ended = controller._hold_ended

        def hold_ended(hold: Any, why: Any) -> None:
            try:
                self._hold_end_reason(hold, str(getattr(why, "value", why)))
            except Exception:  # noqa: BLE001 - never break the product's step
                self._listener_errors.append(traceback.format_exc())
            ended(hold, why)

        controller._hold_ended = hold_ended
        self._hold_now(controller.state.hold)

    # --- cards held for a gaming VM (a prepare) ------------------------------------

    def _hold_changed(self, old: Any, new: Any) -> None:
        """The controller's hold changed (called where the product sets it:
        never raises into it)."""
        try:
            self._hold_set(old, new)
        except Exception:  # noqa: BLE001 - never break the product's step
            self._listener_errors.append(traceback.format_exc())

    def _hold_set(self, old: Any, new: Any) -> None:
        if old is not None and self._hold_open is not None:
            controller = self._controller()
            plan = controller.plan if controller is not None else None
            why = (
                "replaced"
                if new is not None
                else f"{plan.request.kind} of {plan.request.vm} began"
                if plan is not None
                else ""  # the reconcile says why (_hold_end_reason)
            )
            self._close_hold(time.time(), why)
        if new is not None:
            self._open_hold(new)

    def _hold_now(self, hold: Any) -> None:
        """A controller (new after a restart or a reload) holds ``hold``: the
        same as the one that lasts (stored across the restart) or not."""
        open_ = self._hold_open
        if (
            open_ is not None
            and hold is not None
            and (hold.vm, hold.until) == (open_.vm, open_.until_text)
        ):
            return
        if open_ is not None:
            self._close_hold(
                time.time(),
                "not kept by the new controller" if hold is None else "replaced",
            )
        if hold is not None:
            self._open_hold(hold)

    def _open_hold(self, hold: Any) -> None:
        seen = HoldSeen(
            vm=hold.vm,
            until_text=hold.until,
            until=_epoch(hold.until),
            began=time.time(),
            cycle=self.cycle,
        )
        seen.checked_until = seen.began
        self._holds.append(seen)
        if self.records:
            self.records[-1].holds.append(seen)
        self._hold_open = seen

    def _close_hold(self, at: float, why: str) -> None:
        hold, self._hold_open = self._hold_open, None
        if hold is None:
            return
        hold.ended, hold.why = at, why

    def _hold_end_reason(self, hold: Any, why: str) -> None:
        """The controller's reconcile ended ``hold`` (core.HoldEnd): expired,
        plays, gone. Its unused end (expired, gone) asks for the cards back,
        as a session's end does (an edge)."""
        for seen in reversed(self._holds):
            if (seen.vm, seen.until_text) == (hold.vm, hold.until):
                if seen.ended is None:
                    self._hold_open = seen
                    self._close_hold(time.time(), why)
                elif not seen.why:
                    seen.why = why
                if seen.unused:
                    self._edge(f"the hold for {hold.vm} ended ({why})")
                return

    def _hold_expired(self, vm: str, until: str, at: float) -> None:
        """``gpu_handoff_hold_expired`` fired: the hold for ``vm`` ended
        unused (also when the controller that ended it was not traced yet:
        a new one after a restart)."""
        for seen in reversed(self._holds):
            if (seen.vm, seen.until_text) == (vm, until):
                if seen.ended is None:
                    self._hold_open = seen
                    self._close_hold(at, "expired")
                    self._edge(f"the hold for {vm} ended (expired)")
                return

    def _busy(self) -> bool:
        """GPU Handoff has an operation running or waiting, or its lock held
        (the controller does not look at a hold then: _reconcile), or the
        entry is not loaded."""
        controller = self._controller()
        if controller is None:
            return True
        return bool(
            controller._lock.locked()
            or controller.progress.operation is not None
            or controller.plan is not None
            or controller.requests
        )

    async def _watch_holds(self) -> None:
        """While cards are held, sample whether GPU Handoff is busy."""
        while True:
            hold = self._hold_open
            if hold is not None:
                hold.samples.append((time.time(), self._busy()))
            await asyncio.sleep(HOLD_SAMPLE)

    def _on_store(self, event: Any) -> None:
        """Every change the emulator stores (called inside its write)."""
        try:
            kind = event.resource.kind
            if kind == "Node":
                self._node_changed(event)
            elif kind == "Pod":
                self._pod_changed(event)
        except Exception:  # noqa: BLE001 - never break the emulator's write
            self._listener_errors.append(traceback.format_exc())

    def _node_changed(self, event: Any) -> None:
        new, old = event.new, event.old
        if new is None or new["metadata"]["name"] != GPU_NODE:
            return
        boot_id = ((new.get("status") or {}).get("nodeInfo") or {}).get("bootID")
        if boot_id != self._boots[-1][1]:
            self._boots.append((time.time(), boot_id))
        if (
            old is not None
            and (old.get("spec") or {}).get("unschedulable")
            and CORDON_ANNOTATION in (old["metadata"].get("annotations") or {})
            and not (new.get("spec") or {}).get("unschedulable")
            and not self._harness_writing
        ):
            self._lifts.append((self.cycle, time.time()))
        if (
            self.operator_cordon
            and not self._harness_writing
            and not (new.get("spec") or {}).get("unschedulable")
        ):
            mark = (new["metadata"].get("annotations") or {}).get(CORDON_ANNOTATION)
            self._violate(
                "operator_cordon_lifted",
                f"the GPU node was made schedulable under the operator's cordon "
                f"(mark {mark!r}) during {self._phase_text()}",
            )

    def _pod_changed(self, event: Any) -> None:
        old, new = event.old, event.new
        pod = new if new is not None else old
        if (pod.get("spec") or {}).get("nodeName") != GPU_NODE:
            return
        meta = pod["metadata"]
        uid = meta["uid"]
        if uid in self._harness_removed or uid in self._cluster_deleted:
            return
        leaving = new is None or (
            meta.get("deletionTimestamp")
            and not (old or {}).get("metadata", {}).get("deletionTimestamp")
        )
        if leaving and new is not None and self._deleted_by_taint_manager(new):
            # The cluster's doing, not GPU Handoff's: the node is unreachable
            # longer than the pod tolerates; its kubelet finishes it once back.
            self._cluster_deleted.add(uid)
            self._taint_deleted += 1
            return
        if leaving and not any(item[3] == uid for item in self._left):
            self._left.append(
                (
                    self.cycle,
                    meta["namespace"],
                    meta["name"],
                    uid,
                    "deleted" if new is None else "terminating",
                )
            )

    def _deleted_by_taint_manager(self, pod: dict[str, Any]) -> bool:
        """Whether the taint eviction controller marked this pod for deletion:
        its DisruptionTarget condition says DeletionByTaintManager
        (addConditionAndDeletePod) and the GPU node carries the unreachable
        NoExecute taint at that instant."""
        conditions = (pod.get("status") or {}).get("conditions") or []
        marked = any(
            condition.get("type") == "DisruptionTarget"
            and condition.get("reason") == TAINT_MANAGER_REASON
            for condition in conditions
        )
        taints = (self._node().get("spec") or {}).get("taints") or []
        unreachable = any(
            (taint.get("key"), taint.get("effect"))
            == (UNREACHABLE_NO_EXECUTE["key"], UNREACHABLE_NO_EXECUTE["effect"])
            for taint in taints
        )
        return marked and unreachable

    async def _follow_gpu_node(self) -> None:
        """The kubelet stand-in shared with the tests (tests/support/kubelet.py)
        at the rig's pace: the VM stops, the node stays Ready (old bootID,
        old GPUs) until the control plane's grace period ends, then Unknown;
        each boot, a first post with a new bootID and 0 GPUs, the live card
        count once the device plugin registered. The delays are drawn, boot
        after boot, from a generator seeded by the run's seed, in simulated
        seconds scaled as the guests are; the pod network's (a short burst
        of failed sandboxes after each boot) is the stand-in's default,
        scaled, and draws nothing, so the seeds replay as before.

        It plays the ReplicaSet controller and the scheduler for the pods
        that tolerate the cordon (the ReplicaSet's watch: a replacement is
        bound to the node, cordoned or not, the moment the old pod is marked
        for deletion); the demo cluster's workloads come back between cycles
        (``_prepare``)."""
        rng = random.Random(f"gpu-handoff-chaos-kubelet:{self.seed}")  # noqa: S311
        self.cluster.node_monitor_grace_period = NODE_MONITOR_GRACE * TIME_SCALE
        self.cluster.node_monitor_period = NODE_MONITOR_PERIOD * TIME_SCALE
        self.kubelet = kubelet = Kubelet(
            self.sim,
            self.cluster,
            node=GPU_NODE,
            vm=GPU,
            boot_delay=lambda: rng.uniform(*KUBELET_FIRST_POST) * TIME_SCALE,
            plugin_delay=lambda: rng.uniform(*self.plugin_after) * TIME_SCALE,
            network_delay=NETWORK_DELAY * TIME_SCALE,
            sandbox_retry=SANDBOX_RETRY * TIME_SCALE,
            threaded=True,  # the simulator's state is read off the loop
        )
        kubelet.workloads = [
            Workload(
                namespace=MONITORING_NS,
                owner=TOLERANT,
                labels=dict(TOLERANT_LABELS),
                image=TOLERANT_IMAGE,
                gpus=0,
                tolerations=(dict(CORDON_TOLERATION),),
            )
        ]
        kubelet.start()
        try:
            await asyncio.get_running_loop().create_future()  # until the rig closes
        finally:
            await kubelet.stop()

    # --- violations -------------------------------------------------------------------

    def _violate(self, invariant: str, detail: str, cycle: int | None = None) -> None:
        cycle = self.cycle if cycle is None else cycle
        key = (cycle, invariant, detail)
        if any((v.cycle, v.invariant, v.detail) == key for v in self.violations):
            return
        plan = next(
            (record.plan for record in self.records if record.plan.cycle == cycle),
            None,
        )
        violation = Violation(
            self.seed,
            cycle,
            invariant,
            detail,
            lend=self.lend,
            request=plan.request if plan is not None else "",
            faults=plan.faults if plan is not None else (),
        )
        self.violations.append(violation)
        self.log(
            f"chaos: cycle {cycle}: VIOLATION {invariant}: {detail} "
            f"(replay: {violation.replay})"
        )

    def _phase_text(self) -> str:
        controller = self._controller()
        operation = controller.progress.operation if controller is not None else None
        if operation is None:
            return "no operation"
        return f"the {operation.kind} of {operation.vm} at {operation.step}"

    def _controller(self) -> Any:
        if self.entry.state is not ConfigEntryState.LOADED:
            return None
        return self.entry.runtime_data.controller

    # --- the cycle ----------------------------------------------------------------------

    async def run(self, plans: Iterator[Plan] | list[Plan]) -> dict[str, Any]:
        """Run the cycles; the summary."""
        started = time.monotonic()
        for plan in plans:
            await self.run_cycle(plan)
        return self.summary(time.monotonic() - started)

    async def run_cycle(self, plan: Plan) -> CycleRecord:
        """One request, its faults, the settle, the checks, the clean-up."""
        self.cycle = plan.cycle
        mirrored = plan.prepares and await self._prepare_the_other(plan)
        if mirrored:
            plan = mirror(plan)
        record = CycleRecord(plan)
        if mirrored:
            record.observed["prepare_mirrored"] += 1
        self.records.append(record)
        started = time.monotonic()
        await self._prepare()
        self.lag.take()
        self._cycle_began = time.time()
        self._events.clear()
        self._restarts.clear()
        self._fired = []
        self._inapplicable = []
        self._pending = {}
        for fault in plan.faults:
            self._pending.setdefault(fault.moment, []).append(fault)
        racing = (GPU, *GAMING) if plan.socket_race else ()
        await asyncio.to_thread(self.sim.agent_sockets_close_first, *racing)
        asks = await self._asks(plan)
        record.asks = self._asks_sent = asks
        # "before": every fault of the moment has struck when the request goes.
        await asyncio.gather(
            *(self._strike(f) for f in self._pending.pop("before", []))
        )
        self._request_tasks = [
            asyncio.get_running_loop().create_task(
                self._prepare_and_follow(ask, plan)
                if ask.how == "prepare"
                else self._send(ask, plan),
                name="chaos request",
            )
            for ask in asks
        ]
        settled = await self._settle(started + self.settle_bound)
        record.unreached = [
            fault.kind for faults in self._pending.values() for fault in faults
        ]
        self._pending = {}
        record.fired = list(self._fired)
        record.inapplicable = list(self._inapplicable)
        if racing:
            left = await asyncio.to_thread(self.sim.agent_sockets_still_to_close)
            record.observed["agent_socket_eof"] += len(racing) - len(left)
            await asyncio.to_thread(self.sim.agent_sockets_close_first)
        await self._check(plan, record, settled)
        if not settled and self.recover:
            await self._recover()
        await self._clean_up(record)
        record.seconds = time.monotonic() - started
        record.lag_max, record.lag_own = self.lag.take()
        if record.lag_own > LAG_LIMIT:
            self._violate(
                "loop_blocked",
                f"Home Assistant's event loop woke {record.lag_max * 1000:.0f} ms "
                f"late, {record.lag_own * 1000:.0f} ms of it its own (a thread "
                "sleeping beside it was not as late)",
            )
        self.log(
            f"chaos: cycle {plan.cycle}: {plan.request} {plan.vm or ''} "
            f"faults={[f'{f.kind}@{f.moment}' for f in plan.faults]} "
            f"{'socket_race ' if plan.socket_race else ''}"
            f"unreached={record.unreached} inapplicable={record.inapplicable} "
            f"-> {record.outcome} "
            f"[{', '.join(f'{a.vm} {a.want}: {a.status} {a.detail}' for a in asks)}] "
            + "".join(
                f"hold {hold.vm} {hold.as_json()['late_s']} s late ({hold.why}) "
                for hold in record.holds
            )
            + f"{record.seconds:.1f} s, lag {record.lag_max * 1000:.0f} ms "
            f"(own {record.lag_own * 1000:.0f} ms)"
        )
        return record

    async def _prepare_the_other(self, plan: Plan) -> bool:
        """Whether a prepare's cycle is run mirrored (``mirror``): its gaming
        VM plays (a prepare of it would only be refused) and the other does
        not. The plans are alike for either gaming VM; mirrored, the cycle
        prepares the one that does not play, its faults' targets swapped
        alike. Both playing, its player quits first (_prepare_and_follow)."""
        assert plan.vm is not None
        other = next(vm for vm in GAMING if vm != plan.vm)
        world = await asyncio.to_thread(self.sim.world)
        return world.doms[plan.vm].running and not world.doms[other].running

    async def _asks(self, plan: Plan) -> list[Ask]:
        if plan.prepares:
            assert plan.vm is not None
            return [Ask(plan.vm, "prepare", "prepare")]
        if plan.request in ("both_on", "both_off"):
            want = plan.request.removeprefix("both_")
            return [Ask(vm, want, want) for vm in GAMING]
        if plan.request == "return_cards":
            return [Ask(GPU, "return", "return_cards")]
        assert plan.vm is not None
        want = "off" if plan.request == "off" else "on"
        return [Ask(plan.vm, want, plan.request)]

    async def _send(self, ask: Ask, plan: Plan) -> None:
        """Send one request as a user (or a person on the tower) would."""
        try:
            if ask.how == "hand":
                await self._hand_start(ask)
                return
            if ask.how == "return_cards":
                self._edge("return_cards")
            elif ask.how == "off" and await asyncio.to_thread(
                self.sim.is_running, ask.vm
            ):
                self._edge(f"{ask.vm} turned off")
            if ask.how in ("on", "off"):
                state = self.hass.states.get(SWITCHES[ask.vm])
                if state is None or state.state == "unavailable":
                    ask.status = "unavailable"
                    return
                ask.sent_at = time.time()
                await self.hass.services.async_call(
                    "switch",
                    "turn_on" if ask.how == "on" else "turn_off",
                    {"entity_id": SWITCHES[ask.vm]},
                    blocking=True,
                )
            elif ask.how == "return_cards":
                ask.sent_at = time.time()
                await self.hass.services.async_call(
                    DOMAIN,
                    "return_cards",
                    {"config_entry_id": self.entry.entry_id},
                    blocking=True,
                )
            elif ask.how == "prepare":
                controller = self._controller()
                if controller is None:
                    ask.status = "unavailable"  # the action: entry_not_loaded
                    return
                ask.sent_at = time.time()
                # Not the action gpu_handoff.prepare: its hold_minutes is a
                # whole number of minutes, 1 at least, and the soak's holds
                # last seconds (its pace is a hundred times real life's).
                # The action asks the controller just so (hold_minutes * 60
                # seconds) and returns without waiting for the prepare.
                await controller.async_prepare(ask.vm, hold=plan.hold)
            else:
                ask.sent_at = time.time()
                ask.response = await self.hass.services.async_call(
                    DOMAIN,
                    "start_handoff",
                    {
                        "config_entry_id": self.entry.entry_id,
                        "vm": ask.vm,
                        "wait": True,
                    },
                    blocking=True,
                    return_response=True,
                )
        except HomeAssistantError as err:
            ask.status = "refused"
            ask.detail = err.translation_key or str(err)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            ask.status = "cancelled"  # the wait was cut by a restart
        else:
            ask.status = "accepted"

    async def _prepare_and_follow(self, ask: Ask, plan: Plan) -> None:
        """Prepare ``ask.vm`` (a hold of ``plan.hold`` seconds); once the cards
        are held (or the prepare is over without a hold), ``plan.then_after``
        seconds later, the cycle's follow-up as a user would send it: that
        VM's switch on (within the hold: it only starts), the other gaming
        VM's switch on, ``return_cards``, that VM's switch off; or nothing,
        and the hold expires. A follow-up is a request of the cycle as the
        plan's own are (sent and checked as they are). A prepare refused has
        nothing to follow. Both gaming VMs playing (``_prepare_the_other``
        mirrors the plan when only its own does), its player quits first:
        its switch off, a request of the cycle too, carried out before the
        prepare is sent (the cycle's faults may strike there)."""
        if await asyncio.to_thread(self.sim.is_running, ask.vm):
            quits = Ask(ask.vm, "off", "off")
            self._asks_sent.insert(self._asks_sent.index(ask), quits)
            await self._send(quits, plan)
            if quits.status == "accepted":
                self.records[-1].observed["prepare_after_quit"] += 1
                await self._until_over(ask.vm)
        await self._send(ask, plan)
        if ask.status != "accepted" or ask.sent_at is None:
            return
        held = await self._until_held(ask)
        record = self.records[-1]
        follow = plan.follow_up
        if follow == "expire":
            record.observed["prepare_left_to_expire"] += 1
            return
        if held is not None:
            await asyncio.sleep(plan.then_after)
        other = next(vm for vm in GAMING if vm != ask.vm)
        then = {
            "on": Ask(ask.vm, "on", "on"),
            "other_on": Ask(other, "on", "on"),
            "return_cards": Ask(GPU, "return", "return_cards"),
            "off": Ask(ask.vm, "off", "off"),
        }[follow]
        within = held is not None and held.ended is None
        record.observed[
            f"prepare_then_{follow}_{'within_hold' if within else 'unheld'}"
        ] += 1
        self._asks_sent.append(then)
        await self._send(then, plan)

    async def _until_over(self, vm: str) -> None:
        """Until GPU Handoff has no request for ``vm`` any more (its
        operation over, the entry loaded), within the settle bound."""
        deadline = time.monotonic() + self.settle_bound
        while time.monotonic() < deadline:
            controller = self._controller()
            if controller is not None and vm not in controller.requests:
                return
            await asyncio.sleep(HOLD_SAMPLE)

    async def _until_held(self, ask: Ask) -> HoldSeen | None:
        """Until the cards are held for ``ask.vm`` (a hold begun since the
        prepare was sent: it), or the prepare is over without a hold (None):
        its request gone, its operation not running, the entry loaded."""
        assert ask.sent_at is not None
        deadline = time.monotonic() + self.settle_bound
        while time.monotonic() < deadline:
            for hold in reversed(self._holds):
                if hold.vm == ask.vm and hold.began >= ask.sent_at:
                    return hold
            controller = self._controller()
            if controller is not None:
                plan = controller.plan
                if ask.vm not in controller.requests and (
                    plan is None or plan.request.vm != ask.vm
                ):
                    return None
            await asyncio.sleep(HOLD_SAMPLE)
        return None

    async def _hand_start(self, ask: Ask) -> None:
        """Someone starts a gaming VM on the tower (``virsh start``): libvirt
        runs the agent's qemu hook (prepare begin: a request for the cards),
        then refuses the start while the GPU node holds its cards. A start
        that fails otherwise (a missing disk, a VFIO error) is an answer the
        person sees at once: nothing was asked of GPU Handoff."""
        if self.down_flag.exists():
            ask.status, ask.detail = "refused", "libvirt is down"
            return
        if await asyncio.to_thread(self.sim.is_running, ask.vm):
            ask.status, ask.detail = "refused", "already running"
            return

        def start() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [str(self.root / "virsh"), "-c", self.sim.uri, "start", ask.vm],
                capture_output=True,
                text=True,
                check=False,
                timeout=60,
            )

        ask.sent_at = time.time()
        started = await asyncio.to_thread(start)
        if started.returncode == 0:
            ask.status, ask.detail = "accepted", "started"
        elif "is in use by" in started.stderr:
            ask.status, ask.detail = "accepted", "start refused"
        else:
            error = started.stderr.strip().splitlines()
            ask.status = "refused"
            ask.detail = f"start failed: {error[-1] if error else started.returncode}"

    # --- faults -------------------------------------------------------------------------

    def _moment(self, moment: str) -> None:
        """The running operation reached ``moment``: its faults strike."""
        for fault in self._pending.pop(moment, []):
            task = asyncio.get_running_loop().create_task(
                self._strike(fault), name=f"chaos fault {fault.kind}"
            )
            self._fault_tasks.append(task)

    async def _strike(self, fault: Fault) -> None:
        """Start the fault; a fault that lasts a while ends in the background."""
        self._fired.append(fault.kind)
        self.log(f"chaos: cycle {self.cycle}: {fault.kind} at {fault.moment}")
        try:
            ending = await self._begin(fault)
        except InapplicableError as why:
            self._fired.remove(fault.kind)
            self._inapplicable.append(fault.kind)
            self.log(f"chaos: cycle {self.cycle}: {fault.kind} does nothing: {why}")
            return
        except Exception:  # noqa: BLE001 - a fault that could not strike
            self.log(f"chaos: fault {fault.kind} failed: {traceback.format_exc()}")
            self._violate("harness_error", f"{fault.kind}: {traceback.format_exc()}")
            return
        if ending is not None:
            task = asyncio.get_running_loop().create_task(
                ending, name=f"chaos fault {fault.kind} ends"
            )
            self._fault_tasks.append(task)

    async def _begin(self, fault: Fault) -> Awaitable[None] | None:
        kind = fault.kind
        seconds = float(fault.get("seconds", 0.0))
        if kind == "ssh_cut":
            await asyncio.to_thread(self._cut_connections)
        elif kind == "agent_killed":
            await asyncio.to_thread(self._kill_sessions, fault.get("signal"))
        elif kind == "ha_reload":
            async with self._restart_lock:
                await self.hass.config_entries.async_reload(self.entry.entry_id)
                self._restarts.append(time.monotonic())
                self._instrument()
        elif kind == "ha_restart":
            async with self._restart_lock:
                if self.entry.state is ConfigEntryState.LOADED:
                    await self.hass.config_entries.async_unload(self.entry.entry_id)
                await asyncio.sleep(float(fault.get("down", 0.0)))
                if self.entry.state is ConfigEntryState.NOT_LOADED:
                    await self.hass.config_entries.async_setup(self.entry.entry_id)
                self._restarts.append(time.monotonic())
                self._instrument()
        elif kind == "libvirt_down":
            self.down_flag.touch()
            await asyncio.to_thread(self._end_event_streams)
            return self._after(seconds, lambda: self.down_flag.unlink(missing_ok=True))
        elif kind == "guest_agent":
            target = fault.get("target")
            delay = None if fault.get("mode") == "never" else seconds / TIME_SCALE
            await asyncio.to_thread(self.sim.set_agent_delay, target, delay)
            self._restore_later("agent_delay", target, DEFAULT_AGENT_DELAY)
        elif kind == "guest_shutdown":
            target = str(fault.get("target"))
            duration = 1e9 if fault.get("mode") == "ignored" else seconds / TIME_SCALE
            await asyncio.to_thread(self.sim.set_shutdown_duration, target, duration)
            self._restore_later("shutdown_duration", target, DEFAULT_SHUTDOWN)
            # A slow one within the agent's shutdown timeout is a slow stop
            # too; an ignored one ends the slow stop there was.
            self._slow_stops.pop(target, None)
            if fault.get("mode") == "slow" and self._slow_enough(seconds):
                self._slow_stops[target] = SlowStop(
                    target, seconds, time.time(), self.cycle
                )
        elif kind == "slow_graceful_stop":
            await self._slow_graceful_stop(str(fault.get("target")), seconds)
        elif kind == "guest_quits_racing_stop":
            await self._race_stop(str(fault.get("target")))
        elif kind == "libvirtd_restart":
            return await self._restart_libvirtd(
                seconds, socket_activated=bool(fault.get("socket_activated"))
            )
        elif kind == "pdb_refusing":
            self._set_pdb(min_available=1)
            return self._after(seconds, lambda: self._set_pdb(min_available=0))
        elif kind == "eviction_error":
            count, status = int(fault.get("count")), int(fault.get("status"))
            if status == 504:
                self.cluster.throttle(count, resource="pods/eviction", status=504)
            else:
                self.cluster.fail_next(count, status, resource="pods/eviction")
        elif kind == "api_down":
            self.proxy.set_down(True)
            return self._after(seconds, lambda: self.proxy.set_down(False))
        elif kind == "operator_cordon":
            self._operator(fault.get("action"))
        elif kind == "unmanaged_pod":
            self._pod_counter += 1
            name = f"debug-{self.cycle}-{self._pod_counter}"
            self.cluster.add_pod(name, "default", node=GPU_NODE)
            self._unmanaged.add(("default", name))
        elif kind == "start_fails":
            target = str(fault.get("target"))
            if self.records[-1].plan.request not in STARTING_REQUESTS:
                raise InapplicableError("nothing starts a gaming VM this cycle")
            self._armed.add(target)
            # Every start fails until the end of the cycle: the disk stays
            # missing, the VFIO group stays held (a start tried again a few
            # seconds later, as the agent does for a group the last QEMU
            # had not let go of yet, fails again).
            await asyncio.to_thread(
                self.sim.fail_next_start, target, str(fault.get("reason")), every=True
            )
        elif kind == "player_quits":
            seconds = fault.get("seconds")
            await self._player_quits(
                str(fault.get("target")),
                None if seconds is None else float(seconds),
            )
        elif kind == "operator_stop":
            return await self._operator_stop()
        elif kind == "vm_removed":
            await self._remove_vm(str(fault.get("target")))
        elif kind in ("player_starts", "hand_start"):
            await self._start_meanwhile(kind, str(fault.get("target")))
        return None

    async def _start_meanwhile(self, kind: str, target: str) -> None:
        """Someone starts playing on ``target`` while a return waits for the
        GPUs under GPU Handoff's cordon: its switch turned on
        (``player_starts``), or ``virsh start`` on the tower (``hand_start``:
        libvirt runs the agent's hook, and refuses the start while the GPU
        node holds the cards). A request of this cycle like the plan's own
        (sent as they are, checked as they are: carried out or reported, and
        asked for before any handoff to it)."""
        if await asyncio.to_thread(self.sim.is_running, target):
            raise InapplicableError(f"{target} is running already")
        ask = Ask(target, "on", "on" if kind == "player_starts" else "hand")
        self._asks_sent.append(ask)
        self._request_tasks.append(
            asyncio.get_running_loop().create_task(
                self._send(ask, self.records[-1].plan), name=f"chaos {kind}"
            )
        )

    def _edge(self, what: str) -> None:
        """A request for the cards back (``return_cards``, a session GPU
        Handoff knows of ending): from now on GPU Handoff may start a GPU
        node the operator shut down."""
        now = time.time()
        self._edges.append((now, what))
        for stop in self._operator_stops:
            if stop.ended is None:
                stop.ended, stop.why_ended = now, what

    async def _player_quits(self, target: str, seconds: float | None = None) -> None:
        """The player of ``target`` shuts the game down from inside while
        another plays (or is being handed their cards); with ``seconds``
        (real; never drawn, a regression case's) the guest takes that long
        to power off, and the usual duration comes back before the cycle
        after next."""
        world = await asyncio.to_thread(self.sim.world)
        if not world.doms[target].running:
            raise InapplicableError(f"{target} is not running")
        others = {vm for vm in GAMING if vm != target and world.doms[vm].running} | {
            ask.vm for ask in self._asks_sent if ask.want == "on" and ask.vm != target
        }
        if not others:
            raise InapplicableError(f"nobody plays beside {target}")
        if seconds is not None:
            await asyncio.to_thread(
                self.sim.set_shutdown_duration, target, seconds / TIME_SCALE
            )
            self._restore_later("shutdown_duration", target, DEFAULT_SHUTDOWN)
        self._edge(f"{target} quit from inside")
        await asyncio.to_thread(self.sim.guest_shutdown, target)
        self._quits.add(target)

    def _restore_later(self, what: str, target: str, value: Any) -> None:
        """Set ``what`` of ``target`` back to ``value`` before the cycle after
        next (a later fault of the same kind and target moves that on)."""
        self._restores = [
            item for item in self._restores if (item[1], item[2]) != (what, target)
        ]
        self._restores.append((self.cycle + 1, what, target, value))

    def _agent_shutdown_timeout(self) -> float:
        """The agent's shutdown timeout as the rig configured it (real seconds)."""
        data = json.loads(self.config.read_text(encoding="utf-8"))
        return float(data["timeouts"]["shutdown"])

    def _libvirt_agent_wait(self) -> float:
        """libvirt's wait in ``shutdown --mode agent`` (real seconds) as the
        simulator has it."""
        return sim_model.libvirt_wait(self._sim_data(), "agent_shutdown_timeout")

    def _slow_enough(self, seconds: float) -> bool:
        """Whether a guest taking ``seconds`` to power off must be stopped
        within the agent's shutdown timeout (whatever libvirt says)."""
        return seconds < self._agent_shutdown_timeout()

    async def _slow_graceful_stop(self, target: str, seconds: float) -> None:
        """The next graceful shutdowns of ``target`` take ``seconds`` (real)
        until the guest powers off: past libvirt's agent-shutdown wait (it
        answers "Guest agent is not responding" meanwhile, unless the guest's
        agent leaves first: then it accepts at once), within the agent's
        shutdown timeout (it must wait for the power-off and go on).
        The usual duration comes back before the cycle after next."""
        wait = await asyncio.to_thread(self._libvirt_agent_wait)
        timeout = await asyncio.to_thread(self._agent_shutdown_timeout)
        if not wait < seconds < timeout:
            raise ValueError(
                f"a slow stop of {seconds:g} s is not between libvirt's wait "
                f"({wait:g} s) and the agent's shutdown timeout ({timeout:g} s)"
            )
        await asyncio.to_thread(
            self.sim.set_shutdown_duration, target, seconds / TIME_SCALE
        )
        self._restore_later("shutdown_duration", target, DEFAULT_SHUTDOWN)
        self._slow_stops[target] = SlowStop(target, seconds, time.time(), self.cycle)

    async def _race_stop(self, target: str) -> None:
        """The player of ``target`` shuts it down from inside at the instant
        GPU Handoff's stop arrives (the simulator's
        ``guest_shutdown_on_next_stop``: the guest agent leaves at once, the
        domain powers off after its shutdown duration). Only a request of
        this cycle that turns ``target`` off stops it."""
        if not await asyncio.to_thread(self.sim.is_running, target):
            raise InapplicableError(f"{target} is not running")
        if not any(ask.vm == target and ask.want == "off" for ask in self._asks_sent):
            raise InapplicableError(f"no request of this cycle stops {target}")
        await asyncio.to_thread(self.sim.guest_shutdown_on_next_stop, target)
        self._races.append(RaceStop(target, self.cycle, time.time()))

    def _armed_races(self) -> list[str]:
        """The domains whose next ``virsh shutdown`` still races a guest shutdown."""
        return list(self._sim_data().get("guest_shutdown_races") or [])

    def _disarm_races(self) -> None:
        """A race no stop came for ends with its cycle (the simulator keeps it
        for the next ``virsh shutdown`` otherwise)."""
        with sim_model.locked(self.sim.state_dir):
            data = sim_model.load(self.sim.state_dir)
            if data.get("guest_shutdown_races"):
                data["guest_shutdown_races"] = []
                sim_model.save(self.sim.state_dir, data)

    async def _restart_libvirtd(
        self, seconds: float, *, socket_activated: bool
    ) -> Awaitable[None]:
        """libvirtd restarts and is away ``seconds`` (real): every ``virsh
        event --loop`` ends ("Disconnected from qemu:///system due to end of
        file"), a virsh call meanwhile fails (or, socket-activated, waits),
        running domains run on, and once back libvirtd runs the qemu hook's
        ``reconnect begin -`` for each. What follows measures how soon Home
        Assistant's entities of the tower are available again."""
        restart = LibvirtdRestart(self.cycle, seconds, socket_activated)
        await asyncio.to_thread(
            self.sim.restart_libvirtd,
            seconds / TIME_SCALE,
            socket_activated=socket_activated,
        )
        # The simulator's clock took the restart's beginning inside the call:
        # from its return, ``seconds`` end no earlier than libvirtd is back.
        restart.began = time.monotonic()
        self.records[-1].restarts.append(restart)
        return self._follow_restart(restart)

    async def _follow_restart(self, restart: LibvirtdRestart) -> None:
        """While libvirtd is away, note the entities that go unavailable; once
        it is back (it runs the reconnect hooks then, as a real one does at
        its start whoever connects), how long until every entity of the
        tower is available again."""
        back = restart.began + restart.seconds
        went: set[str] = set()
        while time.monotonic() < back:
            went.update(self._unavailable_entities())
            await asyncio.sleep(RECOVERY_SAMPLE)
        restart.back = time.monotonic()
        restart.went_unavailable = sorted(went)
        back_hook = getattr(self.sim, "libvirtd_back", None)
        if back_hook is not None:
            await asyncio.to_thread(back_hook)
        while True:
            now = time.monotonic()
            missing = self._unavailable_entities()
            if not missing:
                restart.available_after = now - restart.back
                return
            if now - restart.back > RECOVERY_WINDOW:
                restart.still_unavailable = missing
                return
            await asyncio.sleep(RECOVERY_SAMPLE)

    def _unavailable_entities(self) -> list[str]:
        """Home Assistant's entities of the tower that are unavailable now:
        every entity of the entry but the screens (a VM that is off has none)
        and those that need the Kubernetes API."""
        if self.entry.state is not ConfigEntryState.LOADED:
            return [f"the entry ({self.entry.state.value})"]
        out = []
        for platform in entity_platform.async_get_platforms(self.hass, DOMAIN):
            if (
                platform.config_entry is None
                or platform.config_entry.entry_id != self.entry.entry_id
                or platform.domain == "image"
            ):
                continue
            for entity in platform.entities.values():
                description = getattr(entity, "entity_description", None)
                if getattr(description, "needs_cluster", False):
                    continue
                state = self.hass.states.get(entity.entity_id)
                if state is None or state.state == "unavailable":
                    out.append(entity.entity_id)
        return sorted(out)

    async def _operator_stop(self) -> Awaitable[None]:
        """The operator powers the GPU node off from inside (``poweroff`` in
        the guest) while GPU Handoff drains it; once it is off, they remove
        the pods left Terminating on the node that is down (``kubectl delete
        --force``: nothing else ever finishes them)."""
        world = await asyncio.to_thread(self.sim.world)
        gpu = world.doms[GPU]
        if not gpu.running or gpu.off_at is not None:
            raise InapplicableError("the GPU node is not running, or shutting down")
        edges = [what for at, what in self._edges if at >= self._cycle_began]
        await asyncio.to_thread(self.sim.guest_shutdown, GPU)
        self._operator_stops.append(
            OperatorStop(self.cycle, time.time(), excused=bool(edges))
        )
        return self._force_delete_when_off()

    async def _force_delete_when_off(self) -> None:
        deadline = time.monotonic() + DRAIN_TIMEOUT + 2.0
        while await asyncio.to_thread(self.sim.is_running, GPU):
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.1)
        while time.monotonic() < deadline:
            for pod in self.cluster.list_objects("Pod"):
                meta = pod["metadata"]
                if (pod.get("spec") or {}).get("nodeName") != GPU_NODE or not meta.get(
                    "deletionTimestamp"
                ):
                    continue
                self._harness_removed.add(meta["uid"])
                with contextlib.suppress(Exception):
                    self.cluster.delete("Pod", meta["name"], meta["namespace"])
            controller = self._controller()
            operation = (
                controller.progress.operation if controller is not None else None
            )
            if operation is None or operation.step != "draining":
                return
            await asyncio.sleep(0.2)

    async def _remove_vm(self, target: str) -> None:
        """The user removes ``target`` from GPU Handoff (its subentry) while
        the tower job runs; the entry reloads. It is added back at the end of
        the cycle (``_clean_up``)."""
        async with self._restart_lock:
            subentry = next(
                (
                    sub
                    for sub in self.entry.subentries.values()
                    if sub.data.get(CONF_DOMAIN_NAME) == target
                ),
                None,
            )
            if subentry is None:
                raise InapplicableError(f"{target} is not configured")
            self._removed[target] = {
                "data": dict(subentry.data),
                "subentry_type": subentry.subentry_type,
                "title": subentry.title,
                "unique_id": subentry.unique_id,
            }
            for ask in self._asks_sent:
                if ask.vm == target:
                    ask.removed = True
            before = self._controller()
            assert self.hass.config_entries.async_remove_subentry(
                self.entry, subentry.subentry_id
            )
            # The entry reloads (its update listener schedules it).
            await self._wait_reloaded(before)
            self._restarts.append(time.monotonic())

    async def _wait_reloaded(self, before: Any, bound: float = 30.0) -> None:
        deadline = time.monotonic() + bound
        while time.monotonic() < deadline:
            controller = self._controller()
            if controller is not None and controller is not before:
                break
            await asyncio.sleep(0.05)
        self._instrument()

    async def _after(self, seconds: float, end: Callable[[], None]) -> None:
        try:
            await asyncio.sleep(seconds)
        finally:
            end()

    def _cut_connections(self) -> None:
        """Kill sshd's per-connection processes: every connection drops; the
        agent processes they ran see their input end."""
        master = self.sshd.process.pid if self.sshd.process else None
        if master is None:
            return
        sessions = [
            pid for pid in _descendants(master) if _comm(pid).startswith("sshd")
        ]
        _signal(sessions, signal.SIGKILL)

    def _kill_sessions(self, how: str) -> None:
        """Kill the agent's session processes (TERM: it ends as at the end of
        its input; KILL: its ``virsh event`` child too, which nothing would
        end otherwise). Job runners are not its to lose: systemd starts them
        outside the SSH session (the simulator's stand-in may still have one
        as a child for a moment, so only the event stream is killed)."""
        procs = _proc_table(str(self.root))
        for proc in procs:
            if proc.verb != "session" or str(self.agent) not in proc.argv:
                continue
            if how == "KILL":
                streams = [
                    child.pid
                    for child in procs
                    if child.ppid == proc.pid and "event" in child.argv
                ]
                _signal([proc.pid, *streams], signal.SIGKILL)
            else:
                _signal([proc.pid], signal.SIGTERM)

    def _end_event_streams(self) -> None:
        """libvirt going away ends every ``virsh event --loop`` connection."""
        for proc in _proc_table(str(self.sim.root)):
            if "event" in proc.argv and "--loop" in proc.argv:
                _signal([proc.pid], signal.SIGTERM)

    def _set_pdb(self, *, min_available: int) -> None:
        name, namespace = PDB
        if self.cluster.get("PodDisruptionBudget", name, namespace) is None:
            return
        self.cluster.modify(
            "PodDisruptionBudget",
            name,
            namespace,
            mutate=lambda pdb: pdb["spec"].update(minAvailable=min_available),
        )

    def _node(self) -> dict[str, Any]:
        node = self.cluster.get("Node", GPU_NODE, "")
        assert node is not None
        return node

    def _operator(self, action: str) -> None:
        """``kubectl cordon`` or ``kubectl uncordon`` of the GPU node."""
        cordoned = bool(self._node()["spec"].get("unschedulable"))
        if action == "place" and not cordoned:
            self._write_node(unschedulable=True)
            self.operator_cordon = True
        elif action == "remove" and cordoned:
            self.operator_cordon = False
            self._write_node(unschedulable=False)

    def _write_node(self, *, unschedulable: bool, unmark: bool = False) -> None:
        def mutate(node: dict[str, Any]) -> None:
            if unschedulable:
                node["spec"]["unschedulable"] = True
            else:
                node["spec"].pop("unschedulable", None)
            if unmark:
                (node["metadata"].get("annotations") or {}).pop(CORDON_ANNOTATION, None)

        self._harness_writing = True
        try:
            self.cluster.modify("Node", GPU_NODE, "", mutate=mutate)
        finally:
            self._harness_writing = False

    # --- settling -------------------------------------------------------------------------

    async def _settle(self, deadline: float) -> bool:
        """Until everything is idle for QUIET seconds without a break; False
        if that did not happen before ``deadline``."""
        quiet_since: float | None = None
        while True:
            now = time.monotonic()
            if await self._idle():
                quiet_since = quiet_since or now
                if now - quiet_since >= QUIET:
                    return True
            else:
                quiet_since = None
            if now > deadline:
                return False
            await asyncio.sleep(0.1)

    async def _idle(self) -> bool:
        self._instrument()
        if any(not task.done() for task in [*self._fault_tasks, *self._request_tasks]):
            return False
        if self.entry.state is not ConfigEntryState.LOADED:
            if self.entry.state is ConfigEntryState.NOT_LOADED:
                # A setup that failed for good is retried as a user would.
                await self.hass.config_entries.async_setup(self.entry.entry_id)
            return False
        controller = self.entry.runtime_data.controller
        if (
            controller.progress.operation is not None
            or controller.plan is not None
            or controller.requests
            # Cards held for a gaming VM: the cycle goes on until the hold
            # ends (a few seconds; hold_outlived judges how late).
            or controller.state.hold is not None
        ):
            return False
        if await asyncio.to_thread(self._active_job_files):
            return False
        if self._quits:
            asked = set(self._quits)
            quitting = await asyncio.to_thread(self._quitting, asked)
            self._quits -= asked - set(quitting)
            if quitting:
                return False
        # Home Assistant has taken up every start by hand the tower recorded
        # (after an SSH cut it learns of them when its session is back).
        recorded = await asyncio.to_thread(self._hook_request_keys)
        return recorded <= controller.memory.seen_hook_requests

    def _hook_request_keys(self) -> set[str]:
        """The keys (HookRequest.key) of the hook's request records."""
        keys = set()
        for path in (self.state_dir / "requests").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                request = json.loads(path.read_text(encoding="utf-8"))
                keys.add(f"{request.get('time')}|{request.get('domain')}")
        return keys

    def _quitting(self, quits: set[str]) -> list[str]:
        """Those of ``quits`` (gaming VMs whose player quit from inside)
        whose guest is still going down. No operation of GPU Handoff waits
        for such a power-off: the cycle is not over until the guest is off
        and GPU Handoff has answered it."""
        world = sim_model.world(self._sim_data())
        return sorted(
            name
            for name in quits
            if world.doms[name].running and world.doms[name].off_at is not None
        )

    def _active_job_files(self) -> list[str]:
        active = []
        for path in (self.state_dir / "jobs").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                job = json.loads(path.read_text(encoding="utf-8"))
                if job.get("state") in ("queued", "running"):
                    active.append(str(job.get("id")))
        return active

    async def _recover(self) -> None:
        """After a cycle that did not settle, Home Assistant is restarted (as
        its user would), so that the next cycles start from a sane world."""
        self.log(f"chaos: cycle {self.cycle}: restarting Home Assistant to recover")
        async with self._restart_lock:
            if self.entry.state is ConfigEntryState.LOADED:
                await self.hass.config_entries.async_unload(self.entry.entry_id)
            await self.hass.config_entries.async_setup(self.entry.entry_id)
            self._instrument()
        await self._settle(time.monotonic() + self.settle_bound)

    # --- the checks at the end of a cycle -----------------------------------------------

    async def _check(self, plan: Plan, record: CycleRecord, settled: bool) -> None:
        if not settled:
            self._violate("unsettled", self._busy_text())
        for error in self._listener_errors:
            self._violate("harness_error", error)
        self._listener_errors.clear()
        # What the cluster did in this world: pods its taint eviction
        # controller deleted, pods a drain left on the cordoned node, returns
        # that waited for the node, and for its device plugin.
        for what, count in (
            ("pods_deleted_by_taint_manager", self._taint_deleted),
            ("pods_came_back", self._came_back),
            ("node_waits", self._node_waits),
            ("gpu_waits", self._gpu_waits),
        ):
            if count:
                record.observed[what] += count
        self._taint_deleted = self._came_back = 0
        self._node_waits = self._gpu_waits = 0
        await self._check_tower_history()
        await self._check_world_history()
        self._check_pods()
        if self.operator_cordon and not self._node()["spec"].get("unschedulable"):
            self._violate("operator_cordon_lifted", "the operator's cordon is gone")
        record.outcome = await self._check_state()
        await self._check_asks(record.asks)
        await self._check_holds()
        self._check_slow_stops(record)
        await self._check_races(record)
        await self._check_restarts(record)
        if settled:
            await self._check_switches()
            await self._check_leaks()

    def _busy_text(self) -> str:
        busy = [
            f"{task.get_name()} running"
            for task in [*self._fault_tasks, *self._request_tasks]
            if not task.done()
        ]
        controller = self._controller()
        if controller is None:
            busy.append(f"entry {self.entry.state}")
        else:
            if controller.progress.operation is not None:
                busy.append(f"operation {self._phase_text()}")
            if controller.plan is not None:
                busy.append(f"plan {controller.plan}")
            if controller.requests:
                busy.append(f"requests {controller.requests}")
        jobs = self._active_job_files()
        if jobs:
            busy.append(f"tower jobs active: {jobs}")
        quitting = self._quitting(self._quits)
        if quitting:
            busy.append(f"players quitting: {quitting}")
        if controller is not None:
            job = controller.progress.pending_job
            if job is not None and job.job_id:
                path = self.state_dir / "jobs" / f"{job.job_id}.json"
                with contextlib.suppress(OSError, ValueError):
                    stored = json.loads(path.read_text(encoding="utf-8"))
                    busy.append(
                        f"its job {job.job_id} is {stored.get('state')} on the tower"
                    )
            session = self.entry.runtime_data.session
            busy.append(f"session connected: {session.connected}")
        return f"not idle {self.settle_bound:.0f} s after the cycle began: " + (
            "; ".join(busy) or "?"
        )

    async def _check_state(self) -> str:
        """The state a settled cycle ends in: a gaming VM playing, or the GPU
        node serving; never nothing."""
        world = await asyncio.to_thread(self.sim.world)
        running = {name for name, dom in world.doms.items() if dom.running}
        if any(vm in running for vm in GAMING):
            if self.lend:
                return await self._check_lending(world, running)
            return "playing"
        if GPU not in running:
            if self._stopped_by_operator():
                return "stopped_by_operator"  # left as the operator left it
            self._violate(
                "half_state",
                "the GPU node is off and no gaming VM runs "
                f"(failures reported: {self._failures_text()})",
            )
            return "half_state"
        self._failure_on_report = False
        if not await self._wait(self._node_ready, 3.0):
            self._violate("harness_error", "the kubelet stand-in did not follow")
        if self._our_cordon() and not await self._wait(
            lambda: not self._our_cordon(), self.cordon_bound
        ):
            self._violate(
                "own_cordon_outlives",
                f"GPU Handoff's cordon ({self._our_cordon()!r}) is still on the GPU "
                f"node {self.cordon_bound:.0f} s after it serves again",
            )
        if self.operator_cordon:
            return "serving_operator_cordon"
        return "serving"

    async def _check_lending(self, world: Any, running: set[str]) -> str:
        """Lending, someone plays: at idle the GPU node serves exactly the free
        cards (its live hostdevs' cards are its defined cards minus those the
        running gaming VMs hold; none free: it is off), uncordoned; or a
        failure is on report (``_on_report``), or the operator shut it down
        (it stays as they left it)."""
        gpu = world.doms[GPU]
        taken = {
            address.rsplit(".", 1)[0]
            for name in running
            if name != GPU
            for address in world.doms[name].addresses()
        }
        defined = {
            address.rsplit(".", 1)[0]
            for address in await asyncio.to_thread(self.sim.defined_hostdevs, GPU)
        }
        free = defined - taken
        lent = (
            {address.rsplit(".", 1)[0] for address in gpu.addresses()}
            if GPU in running
            else set()
        )
        if lent == free:
            self._failure_on_report = False
        elif GPU not in running and self._stopped_by_operator():
            pass
        elif self._on_report():
            # A failure stays on report until the GPU node serves the free
            # cards again: a later cycle that leaves it so (after a restart
            # forgot last_error) is not a new silence.
            self._failure_on_report = True
        elif not self._failure_on_report:
            self._violate(
                "cards_not_lent",
                f"the GPU node {'runs with ' + str(sorted(lent)) if lent else 'is off'}"
                f", the free cards are {sorted(free)}, and no failure was reported",
            )
        if GPU not in running:
            return "playing"
        if self._our_cordon() and not await self._wait(
            lambda: not self._our_cordon(), self.cordon_bound
        ):
            self._violate(
                "own_cordon_outlives",
                f"GPU Handoff's cordon ({self._our_cordon()!r}) is still on the "
                f"lending GPU node {self.cordon_bound:.0f} s after it serves again",
            )
        return "playing_and_lending"

    def _on_report(self) -> bool:
        """Whether a failure is on report now: a ``handoff_failed`` event of
        this cycle, a ``last_error``, or a repair issue of the entry."""
        if any(seen.type == EVENT_HANDOFF_FAILED for seen in self._events):
            return True
        controller = self._controller()
        if controller is not None and any(controller.progress.last_error.values()):
            return True
        entry_id = self.entry.entry_id
        return any(
            domain == DOMAIN
            and entry_id in issue_id
            and issue_id.startswith(("handoff_failed_", "unmanaged_pods_"))
            for domain, issue_id in ir.async_get(self.hass).issues
        )

    def _stopped_by_operator(self) -> bool:
        """Whether the operator's shutdown of the GPU node still stands (no
        request asked for the cards back since)."""
        return any(stop.ended is None for stop in self._operator_stops)

    def _node_ready(self) -> bool:
        return any(
            condition["type"] == "Ready" and condition["status"] == "True"
            for condition in self._node()["status"].get("conditions", [])
        )

    def _boot_id(self) -> str | None:
        """The GPU node's ``status.nodeInfo.bootID`` as the API server has it."""
        return ((self._node().get("status") or {}).get("nodeInfo") or {}).get("bootID")

    def _our_cordon(self) -> str | None:
        node = self._node()
        if not node["spec"].get("unschedulable"):
            return None
        return (node["metadata"].get("annotations") or {}).get(CORDON_ANNOTATION)

    async def _wait(self, what: Callable[[], bool], bound: float) -> bool:
        deadline = time.monotonic() + bound
        while not what():
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def _failures_text(self) -> str:
        return (
            ", ".join(
                f"{seen.data.get('vm')}: {seen.data.get('code')}"
                for seen in self._events
                if seen.type == EVENT_HANDOFF_FAILED
            )
            or "none"
        )

    def _failures(self, vm: str) -> list[Seen]:
        """The ``handoff_failed`` events seen for ``vm``, in order."""
        return [
            seen
            for seen in self._events
            if seen.type == EVENT_HANDOFF_FAILED and seen.data.get("vm") == vm
        ]

    def _reported(self, vm: str) -> str | None:
        """Why a failure for ``vm`` does not count as reported (None: it does)."""
        failures = self._failures(vm)
        if not failures:
            return "no handoff_failed event"
        last = failures[-1]
        if any(at > last.at for at in self._restarts):
            return None  # last_error and repairs live in memory: a restart forgets
        controller = self._controller()
        if controller is None or not controller.progress.last_error.get(vm):
            return f"a failed event ({last.data.get('code')}) but no last_error"
        code = str(last.data.get("code"))
        if code in USER_ACTS:
            issues = ir.async_get(self.hass)
            entry_id = self.entry.entry_id
            if (
                issues.async_get_issue(DOMAIN, f"handoff_failed_{entry_id}_{vm}")
                is None
                and issues.async_get_issue(DOMAIN, f"unmanaged_pods_{entry_id}") is None
            ):
                return f"{code}: no repair issue"
        return None

    async def _check_asks(self, asks: list[Ask]) -> None:
        """A request accepted and not fulfilled was reported; one a later
        request of the cycle overrode (``_superseded``) is not judged."""
        data = await asyncio.to_thread(sim_model.load, self.sim.state_dir)
        world = sim_model.world(data)
        running = {name for name, dom in world.doms.items() if dom.running}
        for ask in asks:
            if ask.how == "start_handoff" and isinstance(ask.response, dict):
                response = ask.response
                if response.get("succeeded") is False and not response.get("error"):
                    self._violate(
                        "silent_failure", f"start_handoff answered {response}"
                    )
            if ask.status not in ("accepted", "cancelled"):
                continue
            if _superseded(ask, asks):
                ask.detail = (ask.detail + " superseded").strip()
                continue
            if ask.want == "on":
                fulfilled = ask.vm in running
            elif ask.want == "prepare":
                # The cards were held for it (or it needed no hold: it ran
                # by the time the prepare acted, which says so in its event).
                fulfilled = any(
                    hold.vm == ask.vm and hold.began >= (ask.sent_at or 0.0)
                    for hold in self._holds
                ) or any(
                    seen.type == EVENT_PREPARE_SUCCEEDED
                    and seen.data.get("vm") == ask.vm
                    for seen in self._events
                )
            elif ask.want == "off":
                fulfilled = ask.vm not in running
            else:
                fulfilled = GPU in running and self._node_ready()
            if fulfilled:
                ask.detail = (ask.detail + " fulfilled").strip()
                continue
            if ask.want == "on" and self._pressed_as_it_quit(ask, data):
                ask.detail = (ask.detail + " superseded").strip()
                continue
            if ask.want == "prepare" and ask.removed:
                # Its VM removed from GPU Handoff while it ran: the prepare
                # is abandoned and holds nothing (Operations._left_behind),
                # as a hold ends when its VM is removed; the cards go back
                # (half_state judges that).
                ask.detail = (ask.detail + " removed").strip()
                continue
            why = self._reported(ask.vm)
            if why is not None and ask.want == "prepare":
                why = self._prepare_reported(ask, asks, why)
            if why is None:
                ask.detail = (ask.detail + " failed, reported").strip()
                self._judge_passing(ask)
                continue
            self._violate(
                "silent_failure",
                f"{ask.how} {ask.vm} ({ask.want}) was accepted, is not done, and "
                f"was not reported: {why}",
            )

    def _pressed_as_it_quit(self, ask: Ask, data: dict[str, Any]) -> bool:
        """Whether an "on" was sent while its VM's player was already
        quitting from inside (``player_quits`` before the press, the guest
        shutting down at it): libvirt says ``running`` until the guest has
        powered off (qemuProcessHandleShutdown sets ``in shutdown`` only
        then), so GPU Handoff finds it playing and the press does nothing,
        and the player's quit, which came first, ends the session: the
        player overrode the press, as a later request would (seed 44, cycle
        26)."""
        if ask.sent_at is None:
            return False
        quit_first = any(
            at <= ask.sent_at and what == f"{ask.vm} quit from inside"
            for at, what in self._edges
        )
        if not quit_first:
            return False
        at = ask.sent_at + float(data.get("clock_offset", 0.0))
        vm = sim_model.world(data, at=at).doms.get(ask.vm)
        return vm is not None and vm.running and vm.off_at is not None

    def _prepare_reported(self, ask: Ask, asks: list[Ask], why: str) -> str | None:
        """Why a failed prepare does not count as reported (None: it does),
        when ``_reported`` found it not so now: its follow-up (a request for
        the same VM sent after the failure) began an operation of that VM,
        which clears its ``last_error`` and repair as any new request does;
        the ``handoff_failed`` event of the prepare, before it, stands."""
        failed = [
            seen
            for seen in self._failures(ask.vm)
            if seen.data.get("kind") == "prepare" and seen.epoch >= (ask.sent_at or 0.0)
        ]
        if failed and any(
            later.vm == ask.vm
            and later is not ask
            and later.sent_at is not None
            and later.sent_at >= failed[-1].epoch
            for later in asks
        ):
            return None
        return why

    def _judge_passing(self, ask: Ask) -> None:
        """A reported failure with a passing failure's code (the product
        tried again until the drain timeout) is marked ``transient``; one
        whose cycle's outages all ended within that bound is a violation:
        the product gave up on a request it could have carried out."""
        last = self._failures(ask.vm)[-1]
        code = str(last.data.get("code"))
        if code not in TRANSIENT_CODES:
            return
        ask.detail += ", transient"
        record = self.records[-1]
        outage = sum(
            float(fault.get("seconds") or 0.0) + RECONNECT
            for fault in record.plan.faults
            if fault.kind in OUTAGES and fault.kind in record.fired
        )
        if outage < DRAIN_TIMEOUT:
            self._violate(
                "passing_failure_reported",
                f"{ask.how} {ask.vm} failed with {code} after outages of "
                f"{outage:.1f} s at most, within the retries' bound of "
                f"{DRAIN_TIMEOUT} s: {last.data.get('error')}",
            )

    async def _check_switches(self) -> None:
        """A switch shows a request only while something works on it, and
        otherwise the VM's state (within SWITCH_GRACE: the agent session
        re-reads what libvirt events cannot tell every few seconds).
        Unavailable claims nothing."""
        if self.entry.state is not ConfigEntryState.LOADED:
            return

        async def wrong() -> list[str]:
            world = await asyncio.to_thread(self.sim.world)
            out = []
            for vm, entity_id in SWITCHES.items():
                state = self.hass.states.get(entity_id)
                shown = state.state if state is not None else "unavailable"
                expected = "on" if world.doms[vm].running else "off"
                if shown in ("on", "off") and shown != expected:
                    out.append(f"{entity_id} shows {shown}, {vm} is {expected}")
            return out

        deadline = time.monotonic() + SWITCH_GRACE
        while (texts := await wrong()) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        for text in texts:
            self._violate("switch_wrong", text)

    def _check_pods(self) -> None:
        """Pods left the GPU node only through accepted evictions, and no pod
        nothing recreates was evicted."""
        requests = self.cluster.requests
        for request in requests[self._requests_seen :]:
            if request.resource == "pods/eviction" and 200 <= request.status < 300:
                key = (request.namespace or "", request.name or "")
                self._accepted_evictions.add(key)
                if key in self._unmanaged:
                    self._violate(
                        "unmanaged_pod_evicted",
                        f"{key[0]}/{key[1]}, which nothing recreates, was evicted",
                    )
        self._requests_seen = len(requests)
        left, self._left = self._left, []
        for cycle, namespace, name, _uid, how in left:
            if (namespace, name) not in self._accepted_evictions:
                self._violate(
                    "pod_left_without_eviction",
                    f"{namespace}/{name} {how} without an accepted eviction",
                    cycle,
                )

    # --- cards held for a gaming VM ------------------------------------------------

    async def _check_holds(self) -> None:
        """``hold_outlived`` for every hold that lasted into this cycle;
        ``cards_not_back_after_hold`` for those that ended unused."""
        now = time.time()
        ended = []
        for hold in self._holds:
            if hold.judged:
                continue
            self._judge_hold_time(hold, now)
            if hold.ended is not None:
                hold.judged = True
                ended.append(hold)
        unused = [hold for hold in ended if hold.unused]
        if not unused:
            return
        world = await asyncio.to_thread(self.sim.world)
        running = {name for name, dom in world.doms.items() if dom.running}
        gpu = world.doms[GPU]
        gpu_cards = _cards(gpu.addresses()) if gpu.running else set()
        for hold in unused:
            dom = world.doms.get(hold.vm)
            self._judge_cards_back(
                hold,
                running=running,
                gpu_cards=gpu_cards,
                held=_cards(dom.addresses()) if dom is not None else set(),
                ready=self._node_ready(),
                cordon=self._our_cordon(),
            )

    def _judge_hold_time(self, hold: HoldSeen, now: float) -> None:
        """``hold_outlived``: once its time is over and GPU Handoff is idle
        (nothing running or waiting, its lock free, the entry loaded), a hold
        ends within HOLD_LATE: the controller looks again every
        HOLD_BUSY_RETRY while it is busy, and that long after an operation's
        end (see HOLD_LATE). The operations in flight at the hold's end
        delay it by what is left of them (their own bounds; ``unsettled``
        judges those): measured from the end of the last of them."""
        overstay = hold_overstay(hold, now)
        if overstay <= HOLD_LATE or hold.reported:
            return
        hold.reported = True
        end = (
            f"ended {hold.ended - hold.until:.2f} s after its time ({hold.why})"
            if hold.ended is not None
            else f"still lasts {now - hold.until:.2f} s after its time"
        )
        self._violate(
            "hold_outlived",
            f"the cards held for {hold.vm} until {_stamp(hold.until)} were "
            f"{end}, {overstay:.2f} s of it with GPU Handoff idle (bound "
            f"{HOLD_LATE:g} s: the controller looks again every "
            f"{HOLD_BUSY_RETRY.total_seconds():g} s)",
        )

    def _judge_cards_back(
        self,
        hold: HoldSeen,
        *,
        running: set[str],
        gpu_cards: set[str],
        held: set[str],
        ready: bool,
        cordon: str | None,
    ) -> None:
        """``cards_not_back_after_hold``: a hold that ended unused (its time
        over: ``gpu_handoff_hold_expired``; or its VM no longer GPU
        Handoff's) brings the cards back as a session's end does: by the
        cycle's end the GPU node runs with the held VM's cards, its node
        Ready, GPU Handoff's cordon gone, and ``cards_returned`` (or
        ``return_unhealthy``) fired after the hold's end. Excused as the
        other invariants excuse: someone plays at the end (the cards went on
        to them: ``half_state``, ``cards_not_lent`` judge that), the
        operator's shutdown of the GPU node stands, a failure reported after
        the hold's end (the return failed, or a request after it)."""
        assert hold.ended is not None
        excuses = sorted(running & set(GAMING))
        if self._stopped_by_operator():
            excuses.append("the operator's shutdown of the GPU node stands")
        excuses.extend(
            f"{seen.data.get('kind')} of {seen.data.get('vm')} failed: "
            f"{seen.data.get('code')}"
            for seen in self._events
            if seen.type == EVENT_HANDOFF_FAILED and seen.epoch >= hold.ended
        )
        if excuses:
            self.records[-1].observed["hold_return_excused"] += 1
            return
        problems = []
        if GPU not in running:
            problems.append("the GPU node is off")
        elif missing := held - gpu_cards:
            problems.append(f"the GPU node runs without {', '.join(sorted(missing))}")
        if not ready:
            problems.append("its node is not Ready")
        if cordon:
            problems.append(f"GPU Handoff's cordon is on ({cordon!r})")
        if not any(
            seen.type in (EVENT_CARDS_RETURNED, EVENT_RETURN_UNHEALTHY)
            and seen.epoch >= hold.ended
            for seen in self._events
        ):
            problems.append("no cards_returned fired after it")
        if problems:
            self._violate(
                "cards_not_back_after_hold",
                f"the cards held for {hold.vm} until {_stamp(hold.until)} were not "
                f"used ({hold.why}, {_stamp(hold.ended)}), nobody plays, and "
                + "; ".join(problems),
            )

    # --- the new faults' own invariants ------------------------------------------

    def _check_slow_stops(self, record: CycleRecord) -> None:
        """``slow_stop_refused``: a graceful stop of a guest that powers off
        after libvirt's agent-shutdown wait but within the agent's shutdown
        timeout never fails (no ``shutdown`` or ``wait_shut_off`` step of it
        failed: not ``shutdown_refused``, not ``shutdown_timeout``) while that
        duration is in effect; libvirt away this cycle excuses it (any virsh
        call may fail then). Counted: stops libvirt gave up on and the agent
        saw through (``slow_stop_outlasted_libvirt``)."""
        outage = sorted(set(record.fired) & LIBVIRT_OUTAGES)
        for job in self._jobs.values():
            for index, step in enumerate(job.get("steps") or []):
                slow = self._slow_stops.get(str(step.get("domain")))
                if (
                    slow is None
                    or step.get("name") not in ("shutdown", "wait_shut_off")
                    or not step.get("started")
                    or step.get("result") not in ("ok", "failed")
                    or _epoch(step["started"]) < slow.since
                    or (job["id"], index) in self._slow_checked
                ):
                    continue
                self._slow_checked.add((job["id"], index))
                detail = str(step.get("detail") or "")
                self.log(
                    f"chaos: cycle {self.cycle}: slow stop of {slow.target} "
                    f"({slow.seconds:g} s), job {job['id']} {step['name']}: "
                    f"{step['result']}: {detail}"
                )
                if step["result"] == "ok":
                    if step["name"] != "shutdown":
                        pass
                    elif detail.startswith("shut off after the shutdown was refused"):
                        record.observed["slow_stop_outlasted_libvirt"] += 1
                    else:  # libvirt saw the power-off within its wait
                        record.observed["slow_stop_accepted"] += 1
                    continue
                record.observed["slow_stop_failed"] += 1
                if outage:
                    continue
                code = (job.get("error") or {}).get("code")
                self._violate(
                    "slow_stop_refused",
                    f"{slow.target} powers off {slow.seconds:g} s after a graceful "
                    f"shutdown (libvirt waits {LIBVIRT_AGENT_WAIT:g} s, the agent "
                    f"{AGENT_TIMEOUTS['shutdown']:g} s); job {job['id']} "
                    f"({job['kind']}) failed its {step['name']} step: {code}: "
                    f"{detail}",
                )

    async def _check_races(self, record: CycleRecord) -> None:
        """``race_stop_failed``: a player who shuts their gaming VM down from
        inside at the instant GPU Handoff's stop arrives changes nothing the
        user sees: the VM ends off (unless a later request of the cycle
        turned it on again, seed 4247 cycle 28), no stop step of it fails and no
        ``shutdown_refused``/``shutdown_timeout`` is reported for it, and
        when nobody plays at the end the GPU node runs and its cards were
        returned (``cards_returned``, or ``return_unhealthy``) after the race,
        as after a plain stop. Excused: libvirt away this cycle, a guest
        whose shutdown outlasts the agent's timeout anyway, the VM removed
        from GPU Handoff; the return part also by a failure reported for
        something else, a restart of Home Assistant, the operator's shutdown
        of the GPU node. A race no stop came for is undone (and counted)."""
        races = [race for race in self._races if race.cycle == self.cycle]
        if not races:
            return
        self._races = [race for race in self._races if race.cycle != self.cycle]
        armed = await asyncio.to_thread(self._armed_races)
        world = await asyncio.to_thread(self.sim.world)
        running = {name for name, dom in world.doms.items() if dom.running}
        for race in races:
            if race.target in armed:
                record.observed["race_without_stop"] += 1
                continue
            race.consumed = True
            record.observed["race_happened"] += 1
            dom = world.doms[race.target]
            duration = dom.seconds("shutdown_duration") or 0.0
            excuses = sorted(set(record.fired) & LIBVIRT_OUTAGES)
            if duration >= AGENT_TIMEOUTS["shutdown"]:
                excuses.append(f"its shutdown takes {duration:g} s")
            if race.target in self._removed:
                excuses.append("removed from GPU Handoff")
            if excuses:
                record.observed["race_excused"] += 1
                continue
            problems = []
            # A later request of the cycle that turns it on again (a player
            # starting at gpu_wait) overrides the stop: it may run.
            overridden = any(
                ask.vm == race.target
                and ask.want == "off"
                and _superseded(ask, record.asks)
                for ask in record.asks
            )
            if race.target in running and not overridden:
                problems.append(f"{race.target} still runs")
            for job in self._jobs.values():
                problems.extend(
                    f"job {job['id']} ({job['kind']}) failed its {step['name']} "
                    f"step: {(job.get('error') or {}).get('code')}: {step.get('detail')}"
                    for step in job.get("steps") or []
                    if step.get("domain") == race.target
                    and step.get("result") == "failed"
                    and step.get("started")
                    and _epoch(step["started"]) >= race.armed
                )
            problems.extend(
                f"handoff_failed {seen.data.get('code')}"
                for seen in self._events
                if seen.type == EVENT_HANDOFF_FAILED
                and seen.data.get("vm") == race.target
                and seen.data.get("code") in SHUTDOWN_FAILURES
                and seen.epoch >= race.armed
            )
            other_failure = any(
                seen.type == EVENT_HANDOFF_FAILED
                and seen.data.get("code") not in SHUTDOWN_FAILURES
                for seen in self._events
            )
            restarted = any(at >= race.armed for at in self._restart_epochs())
            if (
                not running & set(GAMING)
                and not other_failure
                and not restarted
                and not self._stopped_by_operator()
            ):
                returned = any(
                    seen.type in (EVENT_CARDS_RETURNED, EVENT_RETURN_UNHEALTHY)
                    and seen.epoch >= race.armed
                    for seen in self._events
                )
                if GPU not in running:
                    problems.append("nobody plays and the GPU node is off")
                elif not returned:
                    problems.append("nobody plays and no cards_returned fired")
            if problems:
                self._violate(
                    "race_stop_failed",
                    f"{race.target} was shut down from inside as GPU Handoff's "
                    f"stop arrived ({_stamp(race.armed)} armed): "
                    + "; ".join(problems),
                )

    def _restart_epochs(self) -> list[float]:
        """Home Assistant's restarts and reloads of this cycle, as epochs."""
        offset = time.time() - time.monotonic()
        return [at + offset for at in self._restarts]

    async def _check_restarts(self, record: CycleRecord) -> None:
        """``slow_recovery_after_libvirtd``: once libvirtd is back from a
        restart, every entity of the tower (the screens and those that need
        the cluster aside) is available within RECOVERY_BOUND (measured,
        kept in the cycle's record); not held against the product when a
        fault of the cycle took the session away by itself. ``killed_on_
        reconnect``: no domain is killed by libvirtd taking it back (its
        ``reconnect`` hook failed). Counted: reconnect hooks run."""
        runs = await asyncio.to_thread(self.sim.hook_runs)
        fresh, self._hook_runs_seen = runs[self._hook_runs_seen :], len(runs)
        for run in fresh:
            args = run.get("args") or []
            if len(args) > 1 and args[1] == "reconnect":
                record.observed["reconnect_hooks"] += 1
                if run.get("status") != "exit status 0":
                    record.observed["reconnect_hooks_failed"] += 1
        if not record.restarts:
            return
        session = sorted(set(record.fired) & SESSION_FAULTS)
        for restart in record.restarts:
            if session:
                restart.excused = ", ".join(session)
                continue
            if restart.available_after is not None and (
                restart.available_after <= RECOVERY_BOUND
            ):
                continue
            after = (
                f"{restart.available_after:.2f} s"
                if restart.available_after is not None
                else f"more than {RECOVERY_WINDOW:g} s "
                f"({', '.join(restart.still_unavailable)} still unavailable)"
            )
            self._violate(
                "slow_recovery_after_libvirtd",
                f"libvirtd was away {restart.seconds:g} s"
                f"{' (socket-activated)' if restart.socket_activated else ''}; "
                f"Home Assistant's entities of the tower were available again "
                f"{after} after it was back (bound {RECOVERY_BOUND:g} s; "
                f"unavailable meanwhile: {', '.join(restart.went_unavailable) or 'none'})",
            )

    # --- the tower's history -----------------------------------------------------

    async def _check_world_history(self) -> None:
        """What happened on the tower and in the cluster this cycle, against
        the requests sent: handoffs only asked for, cards back only from a
        new boot, an operator's shutdown left as it is, the held cards kept
        from the GPU node."""
        loaded = time.time()
        data = await asyncio.to_thread(self._sim_data)
        actions = data["actions"][self._actions_seen :]
        self._actions_seen = len(data["actions"])
        self._check_asked(actions)
        for action in actions:
            if action.get("op") == "daemon_stop":
                self._violate(
                    "killed_on_reconnect",
                    f"libvirtd killed {action.get('name')} when it took it back "
                    f"after a restart ({_stamp(action['t'])}): its reconnect hook "
                    "failed",
                )
        returned, self._returned = self._returned, []
        # The simulator's replay at each instant, off the event loop.
        worlds = await asyncio.to_thread(
            lambda: [sim_model.world(data, at=item.epoch) for item in returned]
        )
        for item, world in zip(returned, worlds, strict=True):
            self._check_returned(world, item)
        self._check_operator_stops()
        await self._check_held_cards(data, loaded)

    async def _check_held_cards(self, data: dict[str, Any], loaded: float) -> None:
        """``held_card_taken``: while cards are held for a gaming VM, the GPU
        node never runs with one of them (lending off: it does not run; on:
        it is lent every free card but the held VM's). Observed in the
        simulator's replay at the hold's beginning and at every start (or
        create) of the GPU node while it lasted (its live cards change only
        there), up to the tower's record as read at ``loaded``."""
        spans = [
            (hold, hold.checked_until, min(hold.ended or loaded, loaded))
            for hold in self._holds
            if hold.checked_until < min(hold.ended or loaded, loaded)
        ]
        if not spans:
            return

        def replay() -> list[tuple[HoldSeen, float, set[str], list[Run]]]:
            out = []
            for hold, begin, end in spans:
                starts = sorted(
                    float(action["t"])
                    for action in data["actions"]
                    if action.get("name") == GPU
                    and action.get("op") in ("start", "create")
                    and begin < float(action["t"]) < end
                )
                instants = [begin, *starts]
                worlds = [sim_model.world(data, at=at) for at in instants]
                held_dom = worlds[0].doms.get(hold.vm)
                held = _cards(held_dom.addresses()) if held_dom is not None else set()
                runs = [
                    (at, _cards(world.doms[GPU].addresses()))
                    for at, world in zip(instants, worlds, strict=True)
                    if world.doms[GPU].running
                ]
                out.append((hold, end, held, runs))
            return out

        for hold, end, held, runs in await asyncio.to_thread(replay):
            hold.checked_until = end
            self._judge_held_cards(hold, held, runs)

    def _judge_held_cards(
        self, hold: HoldSeen, held: set[str], runs: list[Run]
    ) -> None:
        """``held_card_taken``, judged: ``runs`` are the instants the GPU node
        ran while the hold lasted, with its live cards; ``held`` the held
        VM's cards. None may be among them."""
        for at, cards in runs:
            taken = cards & held
            if taken:
                self._violate(
                    "held_card_taken",
                    f"the GPU node ran with {', '.join(sorted(taken))} at "
                    f"{_stamp(at)} while {hold.vm}'s cards were held for it "
                    f"(held {_stamp(hold.began)} until {_stamp(hold.until)}, "
                    f"lending {'on' if self.lend else 'off'}; the GPU node's "
                    f"cards then: {', '.join(sorted(cards))})",
                )

    def _sim_data(self) -> dict[str, Any]:
        with sim_model.locked(self.sim.state_dir, exclusive=False):
            return sim_model.load(self.sim.state_dir)

    def _check_asked(self, actions: list[dict[str, Any]]) -> None:
        """No handoff without an ask: a handoff GPU Handoff begins
        (``handoff_started`` of kind handoff) and a gaming VM's start on the
        tower (the simulator's record of every start and create) each follow
        a request to turn that VM on sent this cycle (a switch, the
        ``start_handoff`` action, a start by hand the harness made)."""
        asked = [
            (ask.vm, ask.sent_at)
            for ask in self._asks_sent
            if ask.want == "on" and ask.sent_at is not None
        ]

        def follows_ask(vm: str, at: float) -> bool:
            return any(name == vm and sent <= at for name, sent in asked)

        for seen in self._events:
            vm = str(seen.data.get("vm"))
            if (
                seen.type == EVENT_HANDOFF_STARTED
                and seen.data.get("kind") == "handoff"
                and not follows_ask(vm, seen.epoch)
            ):
                self._violate(
                    "handoff_unasked",
                    f"a handoff to {vm} began ({_stamp(seen.epoch)}) and no "
                    f"request of this cycle asked for it ({self._asks_text()})",
                )
        for action in actions:
            name = action.get("name")
            if action.get("op") not in ("start", "create") or name not in GAMING:
                continue
            if not follows_ask(name, float(action["t"])):
                self._violate(
                    "handoff_unasked",
                    f"{name} was started on the tower ({_stamp(action['t'])}) and "
                    f"no request of this cycle asked for it ({self._asks_text()})",
                )

    def _asks_text(self) -> str:
        return (
            ", ".join(
                f"{ask.how} {ask.vm} at {_stamp(ask.sent_at)}"
                if ask.sent_at is not None
                else f"{ask.how} {ask.vm} not sent ({ask.status} {ask.detail})"
                for ask in self._asks_sent
            )
            or "none"
        )

    def _check_returned(self, world: Any, item: Returned) -> None:
        """``cards_returned`` only for a running GPU node whose new boot is
        Ready: at the event's instant the node is Ready=True and its bootID
        is not the one it had before the GPU node's VM last started (the
        simulator's replay at that instant gives the start)."""
        gpu = world.doms[GPU]
        if not gpu.running:
            self._violate(
                "returned_while_off",
                f"cards_returned fired ({_stamp(item.epoch)}) while the GPU node's "
                f"VM was {gpu.state_text(reason=True, t=world.t)}",
                item.cycle,
            )
            return
        before = self._boot_before(float(gpu.boot_t or 0.0))
        if not item.ready or (before is not None and item.boot_id == before):
            self._violate(
                "returned_before_new_boot",
                f"cards_returned fired ({_stamp(item.epoch)}) with the node "
                f"{'Ready' if item.ready else 'not Ready'} and bootID "
                f"{item.boot_id!r}; before the VM's start at "
                f"{_stamp(float(gpu.boot_t or 0.0))} it was {before!r}",
                item.cycle,
            )

    def _boot_before(self, at: float) -> str | None:
        """The bootID the API server had for the node just before ``at``
        (None: the rig began later, that boot's bootID is not known)."""
        earlier = [boot_id for when, boot_id in self._boots if when < at]
        return earlier[-1] if earlier else None

    def _check_operator_stops(self) -> None:
        """A GPU node the operator shut down is not started by a tower job of
        GPU Handoff's (a start or start_free step of the GPU node that
        started it) until a request asks for the cards back: ``return_cards``,
        or a session GPU Handoff knows of ending (a running gaming VM turned
        off, a player quitting from inside). Conservatively, a start is not
        held against GPU Handoff when such a request of the same cycle came
        before the shutdown (the operator stopped a return under way), or
        when a shutdown of GPU Handoff's own was accepted by the GPU node
        after the operator's (the job stopped it too)."""
        ours = [
            (_epoch(step["started"]), _epoch(step["finished"]))
            for job in self._jobs.values()
            for step in job.get("steps") or []
            if step.get("name") == "shutdown"
            and step.get("domain") == GPU
            and step.get("result") == "ok"
            and step.get("started")
            and step.get("finished")
        ]
        for job in self._jobs.values():
            for index, step in enumerate(job.get("steps") or []):
                if (
                    step.get("name") not in ("start", "start_free")
                    or step.get("domain") != GPU
                    or step.get("result") != "ok"
                    or not str(step.get("detail") or "").startswith("started")
                    or (job["id"], index) in self._starts_checked
                ):
                    continue
                self._starts_checked.add((job["id"], index))
                at = _epoch(step["started"])
                for stop in self._operator_stops:
                    if at < stop.at or (stop.ended is not None and at >= stop.ended):
                        continue
                    if stop.excused and stop.cycle == self.cycle:
                        continue
                    if any(stop.at <= end and begin <= at for begin, end in ours):
                        continue
                    self._violate(
                        "operator_stop_undone",
                        f"job {job['id']} ({job['kind']}, by "
                        f"{job.get('requested_by')}) started the GPU node at "
                        f"{_stamp(at)} ({step.get('detail')}); the operator had shut "
                        f"it down at {_stamp(stop.at)} (cycle {stop.cycle}) and no "
                        "request asked for the cards back since",
                    )

    async def _check_tower_history(self) -> None:
        commands, jobs = await asyncio.to_thread(self._read_tower)
        for record in commands:
            names = [c[0] for c in record.get("commands") or []]
            argv = " ".join(record.get("argv") or [])
            if FORCED & set(names) or (
                record.get("commands") is None and any(f in argv for f in FORCED)
            ):
                self._violate("destroy_sent", f"virsh {argv}")
        for record, domain, alive_without_agent in await asyncio.to_thread(
            self._shutdowns_checked, commands
        ):
            if alive_without_agent:
                self._violate(
                    "stop_before_guest_agent",
                    f"virsh {' '.join(record.get('argv') or [])}: {domain} was "
                    "running and its guest agent not connected",
                )
        for job in jobs:
            self._jobs[job["id"]] = job
        by_request: dict[str, list[str]] = {}
        for job in self._jobs.values():
            if job.get("request_id"):
                by_request.setdefault(job["request_id"], []).append(job["id"])
        for request_id, ids in by_request.items():
            if len(ids) > 1:
                self._violate(
                    "duplicate_job", f"request {request_id}: jobs {sorted(ids)}"
                )
        self._check_rollbacks()
        ordered = sorted(
            (job for job in self._jobs.values() if job.get("started")),
            key=lambda job: job["started"],
        )
        for before, after in itertools.pairwise(ordered):
            finished = before.get("finished")
            if finished is None or finished > after["started"]:
                self._violate(
                    "overlapping_jobs",
                    f"{after['id']} ({after['kind']}) started {after['started']} "
                    f"while {before['id']} ({before['kind']}) ran until {finished}",
                )

    def _check_rollbacks(self) -> None:
        """GPU Handoff's cordon was never lifted while a job that may stop the
        GPU node ran (a handoff, or a stop of the GPU node)."""
        lifts, self._lifts = self._lifts, []
        stopping = [
            job
            for job in self._jobs.values()
            if job.get("started")
            and (
                job.get("kind") == "handoff"
                or (
                    job.get("kind") == "stop"
                    and (job.get("args") or {}).get("domain") == GPU
                )
            )
        ]
        for cycle, at in lifts:
            for job in stopping:
                began = _epoch(job["started"])
                ended = _epoch(job["finished"]) if job.get("finished") else None
                if began <= at and (ended is None or at < ended):
                    self._violate(
                        "rollback_under_running_job",
                        f"GPU Handoff's cordon was lifted while job {job['id']} "
                        f"({job['kind']}, by {job.get('requested_by')}) ran",
                        cycle,
                    )

    def _read_tower(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """New virsh commands (finished ones), and every job record as the
        agent's ``jobs`` verb settles them (dead runners marked failed)."""
        path = Path(self.sim.state_dir) / sim_model.COMMANDS_FILE
        finished: list[dict[str, Any]] = []
        if path.exists():
            with path.open(encoding="utf-8") as handle:
                handle.seek(self._commands_offset)
                text = handle.read()
            complete, _, _rest = text.rpartition("\n")
            self._commands_offset += len(complete.encode()) + (1 if complete else 0)
            for line in complete.splitlines():
                if not line:
                    continue
                rec = sim_model.parse_record(line)
                if rec["kind"] == "start":
                    finished.append(rec)
                    for command in rec.get("commands") or []:
                        if command[:1] == ["qemu-agent-command"] and any(
                            "guest-ping" in token for token in command
                        ):
                            self._pings[rec["id"]] = (
                                command[command.index("--domain") + 1]
                                if "--domain" in command
                                else command[1]
                            )
                elif rec["kind"] == "end" and rec["id"] in self._pings:
                    domain = self._pings.pop(rec["id"])
                    if rec.get("rc") == 0:
                        self._answered.setdefault(domain, []).append(float(rec["t"]))
        subprocess.run(
            [sys.executable, str(self.agent), "--config", str(self.config), "jobs"],
            capture_output=True,
            check=False,
            timeout=60,
        )
        jobs = []
        for job_path in (self.state_dir / "jobs").glob("*.json"):
            with contextlib.suppress(OSError, ValueError):
                jobs.append(json.loads(job_path.read_text(encoding="utf-8")))
        return finished, jobs

    def _shutdowns_checked(
        self, commands: list[dict[str, Any]]
    ) -> list[tuple[dict[str, Any], str, bool]]:
        """For each ``shutdown`` sent: whether its domain ran without a
        connected guest agent at that instant."""
        shutdowns = [
            (record, command[-1])
            for record in commands
            for command in record.get("commands") or []
            if command and command[0] == "shutdown" and len(command) > 1
        ]
        if not shutdowns:
            return []
        with sim_model.locked(self.sim.state_dir, exclusive=False):
            data = sim_model.load(self.sim.state_dir)
        out = []
        for record, domain in shutdowns:
            at = float(record["t"])
            world = sim_model.world(data, at=at)
            dom = world.doms.get(domain)
            alone = dom is not None and dom.running and not dom.agent_connected
            if alone:
                answered = self._answered.get(domain, [])
                alone = not cleared_by_ping(data, answered, domain, at)
            out.append((record, domain, alone))
        return out

    # --- leaks --------------------------------------------------------------------

    async def _check_leaks(self) -> None:
        """Once settled: nothing left running or held on the tower, no task of
        Home Assistant's for a finished operation."""
        deadline = time.monotonic() + LEAK_GRACE
        while True:
            leaks = await asyncio.to_thread(self._tower_leaks)
            leaks += self._task_leaks()
            if not leaks or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        for invariant, detail in leaks:
            self._violate(invariant, detail)

    def _tower_leaks(self) -> list[tuple[str, str]]:
        leaks: list[tuple[str, str]] = []
        procs = _proc_table(str(self.root))
        agent = str(self.agent)
        virsh = str(self.sim.virsh)  # the fork server's client, or a wrapper
        sessions = [p for p in procs if agent in p.argv and p.verb == "session"]
        session_pids = {p.pid for p in sessions}
        for proc in procs:
            line = " ".join(proc.argv)[:200]
            if agent in proc.argv:
                if "run-job" in proc.argv:
                    leaks.append(("leaked_runner", f"pid {proc.pid}: {line}"))
                elif proc.verb and proc.verb != "session" and proc.age > ONE_SHOT_AGE:
                    leaks.append(
                        ("leaked_process", f"{proc.verb} agent, {proc.age:.0f} s old")
                    )
            elif proc.argv[:1] == [virsh] or any(
                part.endswith(".virsh.py") for part in proc.argv
            ):
                if "event" in proc.argv and proc.ppid not in session_pids:
                    leaks.append(
                        ("leaked_process", f"virsh event of no session: {line}")
                    )
                elif "event" not in proc.argv and proc.age > ONE_SHOT_AGE:
                    leaks.append(("leaked_process", f"virsh {proc.age:.0f} s: {line}"))
            elif any(part.endswith(".supervise.py") for part in proc.argv):
                leaks.append(("leaked_runner", f"unit supervisor {line}"))
        if len(sessions) > 1:
            leaks.append(
                (
                    "leaked_process",
                    f"{len(sessions)} agent sessions: pids {sorted(session_pids)}",
                )
            )
        leaks.extend(
            ("leaked_runner", f"unit {unit.name} is {unit.state}")
            for unit in self.sim.loaded_units()
            if unit.state in ("activating", "active")
        )
        locks = [
            self.state_dir / "tower.lock",
            self.state_dir / "submit.lock",
            *(self.state_dir / "jobs").glob("*.lock"),
        ]
        leaks.extend(
            ("lock_held", f"{path.name} is held")
            for path in locks
            if path.exists() and not _lock_free(path)
        )
        leaks.extend(
            ("unfinished_job", f"job {job_id} is still queued or running")
            for job_id in self._active_job_files()
        )
        return leaks

    def _task_leaks(self) -> list[tuple[str, str]]:
        tasks = getattr(self.entry, "_background_tasks", set())
        return [
            ("leaked_task", f"{task.get_name()} still running")
            for task in tasks
            if not task.done() and task.get_name() == f"{DOMAIN} operation"
        ]

    # --- between cycles ----------------------------------------------------------------

    async def _prepare(self) -> None:
        """The cluster's controllers and the sim's guests before a cycle:
        evicted workload pods come back on a serving GPU node; guest faults
        of the cycle before last end."""
        for until, what, target, value in list(self._restores):
            if until <= self.cycle - 1:
                self._restores.remove((until, what, target, value))
                setter = (
                    self.sim.set_agent_delay
                    if what == "agent_delay"
                    else self.sim.set_shutdown_duration
                )
                await asyncio.to_thread(setter, target, value)
                if what == "shutdown_duration":
                    self._slow_stops.pop(target, None)
        node = self._node()
        if self._node_ready() and not node["spec"].get("unschedulable"):
            self._recreate_workloads()

    def _recreate_workloads(self) -> None:
        pods = self.cluster.list_objects("Pod", WORKLOAD_NS)
        for replicaset, labels in WORKLOADS.items():
            owner_obj = self.cluster.get("ReplicaSet", replicaset, WORKLOAD_NS)
            if owner_obj is None:
                continue
            have = [
                pod
                for pod in pods
                if pod["spec"].get("nodeName") == GPU_NODE
                and not pod["metadata"].get("deletionTimestamp")
                and any(
                    ref.get("uid") == owner_obj["metadata"]["uid"]
                    for ref in pod["metadata"].get("ownerReferences") or []
                )
            ]
            if have:
                continue
            self._pod_counter += 1
            self._add_gpu_node_pod(
                f"{replicaset}-c{self.cycle}x{self._pod_counter}",
                labels,
                owner_obj,
                gpu_request=1,
            )

    async def _clean_up(self, record: CycleRecord) -> None:
        """What the operator does after a cycle, and repairs after a
        violation so the next cycle starts from a sane world: the emulator's
        unspent faults dropped, the operator's cordon and pod removed."""
        self.cluster._faults.clear()  # unspent injected failures
        self.proxy.set_down(False)
        self.down_flag.unlink(missing_ok=True)
        self._set_pdb(min_available=0)
        for namespace, name in sorted(self._unmanaged):
            pod = self.cluster.get("Pod", name, namespace)
            if pod is not None:
                self._harness_removed.add(pod["metadata"]["uid"])
                self.cluster.remove_pod(name, namespace)
        self._unmanaged.clear()
        if self.operator_cordon:
            self.operator_cordon = False
            self._write_node(unschedulable=False)
        for vm in sorted(self._armed):
            await asyncio.to_thread(self.sim.clear_start_failure, vm)
        self._armed.clear()
        await asyncio.to_thread(self._disarm_races)
        if record.outcome in ("half_state", "stopped_by_operator"):
            # The administrator starts the GPU node again (the operator who
            # shut it down, once nobody plays).
            await asyncio.to_thread(
                subprocess.run,
                [str(self.sim.virsh), "-c", self.sim.uri, "start", GPU],
                capture_output=True,
                check=False,
            )
        if self._stopped_by_operator() and await asyncio.to_thread(
            self.sim.is_running, GPU
        ):
            now = time.time()
            for stop in self._operator_stops:
                if stop.ended is None:
                    stop.ended, stop.why_ended = now, "running again"
        if (
            record.outcome in ("half_state", "serving", "stopped_by_operator")
            and self._our_cordon()
        ):
            self._write_node(unschedulable=False, unmark=True)
        self._fault_tasks = [task for task in self._fault_tasks if not task.done()]
        self._request_tasks = []
        if self._removed:
            await self._add_back()

    async def _add_back(self) -> None:
        """The gaming VMs removed this cycle are added back (the entry
        reloads), so that the soak goes on with both."""
        async with self._restart_lock:
            for _vm, fields in sorted(self._removed.items()):
                before = self._controller()
                self.hass.config_entries.async_add_subentry(
                    self.entry,
                    ConfigSubentry(
                        data=MappingProxyType(fields["data"]),
                        subentry_type=fields["subentry_type"],
                        title=fields["title"],
                        unique_id=fields["unique_id"],
                    ),
                )
                await self._wait_reloaded(before)
            self._removed.clear()
        if not await self._settle(time.monotonic() + self.settle_bound):
            self._violate("unsettled", "after the removed gaming VM was added back")

    # --- the summary --------------------------------------------------------------------

    def summary(self, wall: float) -> dict[str, Any]:
        """The run in one JSON-able dict."""
        fired: Counter[str] = Counter()
        unreached: Counter[str] = Counter()
        inapplicable: Counter[str] = Counter()
        moments: Counter[str] = Counter()
        requests: Counter[str] = Counter()
        outcomes: Counter[str] = Counter()
        asks: Counter[str] = Counter()
        observed: Counter[str] = Counter()
        restarts: list[LibvirtdRestart] = []
        holds: list[HoldSeen] = []
        for record in self.records:
            holds.extend(record.holds)
            observed.update(record.observed)
            restarts.extend(record.restarts)
            fired.update(record.fired)
            unreached.update(record.unreached)
            inapplicable.update(record.inapplicable)
            moments.update(
                f.moment for f in record.plan.faults if f.kind in record.fired
            )
            requests[record.plan.request] += 1
            outcomes[record.outcome or "unknown"] += 1
            for ask in record.asks:
                status = ask.status
                if "superseded" in ask.detail:
                    status = "superseded"
                elif ask.status in ("accepted", "cancelled"):
                    # A failure the world made certain, or a passing one
                    # (tried again until the drain timeout, in vain).
                    status = (
                        "fulfilled"
                        if "fulfilled" in ask.detail
                        else "failed_transient"
                        if "transient" in ask.detail
                        else "failed_by_the_world"
                    )
                asks[status] += 1
        seconds = [record.seconds for record in self.records]
        lags = [record.lag_max for record in self.records]
        recovered = [
            r.available_after for r in restarts if r.available_after is not None
        ]
        return {
            "seed": self.seed,
            "lend": self.lend,
            "cycles": len(self.records),
            "wall_s": round(wall, 1),
            "requests": dict(sorted(requests.items())),
            "faults": {
                "fired": dict(sorted(fired.items())),
                "unreached": dict(sorted(unreached.items())),
                "inapplicable": dict(sorted(inapplicable.items())),
                "by_moment": {m: moments[m] for m in MOMENTS if moments[m]},
                "total_fired": sum(fired.values()),
            },
            "outcomes": dict(sorted(outcomes.items())),
            "requests_ended": dict(sorted(asks.items())),
            "seconds_per_cycle": {
                "mean": round(statistics.fmean(seconds), 2) if seconds else 0,
                "p50": round(statistics.median(seconds), 2) if seconds else 0,
                "max": round(max(seconds), 2) if seconds else 0,
            },
            # What the faults did: slow stops libvirt gave up on and the agent
            # saw through, races that happened, reconnect hooks run...
            "observed": dict(sorted(observed.items())),
            # Each libvirtd restart: seconds until Home Assistant's entities of
            # the tower were available again after it was back (by cycle).
            "libvirtd_restarts": {
                "count": len(restarts),
                "went_unavailable": sum(1 for r in restarts if r.went_unavailable),
                "available_after_max_s": round(max(recovered), 2)
                if recovered
                else None,
                "not_recovered": sum(1 for r in restarts if r.available_after is None),
                "by_cycle": {str(r.cycle): r.as_json() for r in restarts},
            },
            # Cards held for a gaming VM (prepare): how each hold ended, how
            # late after its time those that expired ended, and the longest
            # a hold outlived its time with GPU Handoff idle (bound HOLD_LATE).
            "holds": {
                "count": len(holds),
                "ended": dict(sorted(Counter(h.why or "?" for h in holds).items())),
                "expired_late_max_s": round(
                    max(
                        (h.ended - h.until for h in holds if h.why == "expired"),
                        default=0.0,
                    ),
                    2,
                ),
                "overstay_idle_max_s": round(
                    max(
                        (hold_overstay(h, h.ended or time.time()) for h in holds),
                        default=0.0,
                    ),
                    2,
                ),
                "bound_s": HOLD_LATE,
            },
            "loop_lag_max_ms": round(max(lags, default=0.0) * 1000, 1),
            "loop_lag_own_max_ms": round(
                max((r.lag_own for r in self.records), default=0.0) * 1000, 1
            ),
            "loop_lag_limit_ms": round(LAG_LIMIT * 1000),
            "tower_jobs": len(self._jobs),
            "violations": [violation.as_json() for violation in self.violations],
        }


async def run_soak(
    hass: HomeAssistant,
    cluster: K8sEmulator,
    root: Path,
    *,
    seed: int,
    cycles: int | None = None,
    plans: list[Plan] | None = None,
    agent: Path = AGENT,
    settle_bound: float = SETTLE_BOUND,
    cordon_bound: float = CORDON_NET_BOUND,
    recover: bool = True,
    log: Callable[[str], None] | None = None,
    lend: bool = False,
    plugin_after: tuple[float, float] = DEVICE_PLUGIN_AFTER,
) -> dict[str, Any]:
    """Build the rig, run ``plans`` (or cycles 1..``cycles`` of ``seed``),
    tear it down; the summary. ``plugin_after``: the bounds the device
    plugin's delay after each boot is drawn between (simulated seconds; a
    test may pin it long, so that every return waits for the GPUs)."""
    rig = ChaosRig(
        hass,
        cluster,
        root,
        seed=seed,
        agent=agent,
        settle_bound=settle_bound,
        cordon_bound=cordon_bound,
        recover=recover,
        log=log,
        lend=lend,
        plugin_after=plugin_after,
    )
    if plans is None:
        assert cycles is not None
        plans = [plan_cycle(seed, cycle) for cycle in range(1, cycles + 1)]
    try:
        await rig.start()
        return await rig.run(plans)
    finally:
        await rig.close()
