"""Tower jobs: asked for under a stored request id, followed to their end.

A job is asked for under a request id its host stores before the request is
sent; a reply lost on the way is followed by a look-up of that id, so a job is
never asked for twice. Progress comes from the agent session's pushes while it
is open, and from reading the job while it is not. No Home Assistant imports.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
import contextlib
from dataclasses import dataclass, replace
import logging
import secrets
from typing import Final, Protocol

from .core import PendingJob
from .protocol import JobKind, JobRecord, JobState, StepName, TowerStatus
from .tower_client import AgentCommandError, TowerClient, TowerConnectionError

_LOGGER = logging.getLogger(__name__)

# How long a job may be followed through tower outages before giving up.
JOB_WAIT_MAX: Final = 1800.0
# While the session is down, job progress is polled this often.
JOB_POLL: Final = 1.0
# With the session up, progress is pushed; a job silent this long is re-read.
JOB_SILENCE: Final = 10.0
RETRY_START: Final = 0.5
RETRY_MAX: Final = 10.0

# The agent's job steps, as the steps a user sees.
AGENT_STEPS: Final = {
    StepName.WAIT_AGENT: "waiting_for_guest_agent",
    StepName.SHUTDOWN: "stopping",
    StepName.WAIT_SHUT_OFF: "stopping",
    StepName.WAIT_DEVICES_FREE: "waiting_for_cards",
    StepName.START: "starting",
    StepName.START_FREE: "starting",
}

# Jobs that may start the GPU node.
STARTS_GPU_NODE: Final = frozenset({JobKind.RELEASE, JobKind.LEND})


class JobFailedError(Exception):
    """A tower job ended in failure; ``record`` says which step failed."""

    def __init__(self, record: JobRecord) -> None:
        error = record.job.error
        super().__init__(error.message if error else "the tower job failed")
        self.code = error.code if error else "job_failed"
        self.record = record


@dataclass(frozen=True, kw_only=True)
class DoneJob:
    """A tower job followed to its end, and the GPU node's bootID before it."""

    record: JobRecord
    boot_before: str | None

    def booted(self, gpu_node: str) -> str | None:
        """The boot that no longer counts when the job started the GPU node
        (None when it did not, or the bootID was not known)."""
        started = self.record.did(StepName.START, gpu_node) or self.record.did(
            StepName.START_FREE, gpu_node
        )
        return self.boot_before if started else None


def new_request_id() -> str:
    """A request id the agent accepts (and no one else will choose)."""
    return f"ha-{secrets.token_hex(12)}"


async def first_of[T](work: Awaitable[T], until: Awaitable[None]) -> T | None:
    """``work``'s result, or None as soon as ``until`` ends first (``work``
    is cancelled then); an error of ``work`` is raised."""
    task = asyncio.ensure_future(work)
    stop = asyncio.ensure_future(until)
    try:
        await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for each in (task, stop):
            if not each.done():
                each.cancel()
        await asyncio.gather(task, stop, return_exceptions=True)
    if task.done() and not task.cancelled():
        return task.result()
    return None


class JobHost(Protocol):
    """What the job follower tells, and asks of, its host."""

    def step(self, step: str) -> None:
        """The operation is at ``step``."""

    def show_tower(self, status: TowerStatus) -> None:
        """The tower as just read."""

    @property
    def pending_job(self) -> PendingJob | None:
        """The tower job the stored operation asked for, if any."""

    async def save_job(self, job: PendingJob | None) -> None:
        """Store the tower job before it is asked for, and once it is known."""


class TowerJobs:
    """The tower jobs of one tower's operations, and the records its agent
    session pushes (of any job: each follower picks its own)."""

    def __init__(self, tower: TowerClient, *, gpu_node: str, host: JobHost) -> None:
        """Nothing is asked for until an operation runs a job."""
        self.tower = tower
        self.gpu_node = gpu_node
        self._host = host
        self._records: dict[str, JobRecord] = {}
        self._shown: dict[str, int] = {}  # steps shown, by job id
        self._pushed = asyncio.Event()
        self._pushes = 0  # records pushed so far

    def pushed(self, record: JobRecord) -> None:
        """A job record the session pushed (any job; the follower picks its own)."""
        self._records[record.job.id] = record
        self._pushes += 1
        self._pushed.set()

    def wake(self) -> None:
        """The session opened or ended: followers look again."""
        self._pushed.set()

    def session_up(self) -> bool:
        """Whether the agent's session is open (progress is pushed)."""
        session = self.tower.session
        return session is not None and not session.closed

    async def run(
        self,
        kind: JobKind,
        domain: str | None,
        *,
        boot_id: Callable[[], Awaitable[str | None]],
        ended: Callable[[JobRecord], None],
    ) -> DoneJob:
        """Ask for a tower job of ``kind`` (or pick up the one the stored
        operation asked for, whatever its kind) and follow it to its end; its
        steps show as the operation's. ``boot_id`` reads the GPU node's
        bootID before a job that may start it; ``ended`` takes the record
        before the job is cleared from storage (what it did is stored with
        it)."""
        pending = self._host.pending_job
        if pending is None:
            pending = PendingJob(
                kind=kind,
                domain=domain,
                request_id=new_request_id(),
                boot_id=await boot_id() if kind in STARTS_GPU_NODE else None,
            )
            await self._host.save_job(pending)  # stored before it is sent
        job_id = pending.job_id
        if job_id is None:
            job_id = await self._submit(pending)
            await self._host.save_job(replace(pending, job_id=job_id))
        record = await self.follow(job_id)
        ended(record)
        await self._host.save_job(None)
        if record.job.state is JobState.FAILED:
            raise JobFailedError(record)
        # What the job did, shown before the next step (a push may lag it).
        with contextlib.suppress(TowerConnectionError, AgentCommandError):
            self._host.show_tower(await self.tower.status())
        return DoneJob(record=record, boot_before=pending.boot_id)

    async def _submit(self, pending: PendingJob) -> str:
        """The job id for ``pending``'s request id: asked for, or, after a reply
        that did not come, looked up. Tries until it knows (bounded by
        JOB_WAIT_MAX): while it does not, a job may run, so nothing here gives
        up early and nothing is rolled back."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + JOB_WAIT_MAX
        delay = RETRY_START
        ask = True
        while True:
            try:
                if ask:
                    submitted = await self.tower.submit(
                        pending.kind, pending.domain, pending.request_id
                    )
                    return submitted.id
                found = await self.tower.find_request(pending.request_id)
                if found is not None:
                    return found.job.id
                ask = True  # never made: asking again under the same id is safe
                continue
            except TowerConnectionError as err:
                if loop.time() > deadline:
                    raise
                _LOGGER.info(
                    "No answer about job request %s (%s); looking it up",
                    pending.request_id,
                    err,
                )
                ask = False
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    async def follow(self, job_id: str) -> JobRecord:
        """Follow a job to its end: from the session's pushes while it is open,
        by reading it while it is not (and once after each reconnect)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + JOB_WAIT_MAX
        read_under: object = None  # the session the last read was made under
        record: JobRecord | None = None
        while True:
            session = self.tower.session if self.session_up() else None
            if session is None or session is not read_under or record is None:
                # No session, a new one, or nothing known: read the job.
                try:
                    record = await self.tower.job(job_id)
                except TowerConnectionError:
                    if loop.time() > deadline:
                        raise
                    await asyncio.sleep(JOB_POLL)
                    continue
                read_under = session
                # What was read is newer than anything pushed before it.
                self._records.pop(job_id, None)
            pushed = self._records.get(job_id) if session is not None else None
            if pushed is not None:
                record = pushed
            self._show(record)
            if not record.job.state.active:
                self._records.pop(job_id, None)
                self._shown.pop(job_id, None)
                return record
            if session is None:
                await asyncio.sleep(JOB_POLL)
                continue
            try:
                async with asyncio.timeout(JOB_SILENCE):
                    await self._next_push(job_id, record)
            except TimeoutError:
                record = None  # silent for long: read it again

    async def _next_push(self, job_id: str, seen: JobRecord) -> None:
        """Until a newer record of ``job_id`` is pushed, or the session ends."""
        while self._records.get(job_id) in (None, seen) and self.session_up():
            self._pushed.clear()
            await self._pushed.wait()

    def _show(self, record: JobRecord) -> None:
        """Every step the job has begun since the last record shown, in
        order: a step that came and went between two pushes is still told."""
        shown = self._shown.get(record.job.id, 0)
        for step in record.steps[shown:]:
            if step.started is None:
                break
            name = AGENT_STEPS[step.name]
            role = "gpu_node" if step.domain == self.gpu_node else "vm"
            self._host.step(f"{name}_{role}")
            shown += 1
        self._shown[record.job.id] = shown

    async def until_tower(self, seen: Callable[[TowerStatus], bool]) -> None:
        """Until the tower's status is ``seen``. It is read at once, after
        every push (a job that began and ended between two looks is still
        seen: the GPU node it stopped is off), every JOB_POLL seconds while no
        session pushes, and every JOB_SILENCE seconds while one does (a push
        may be lost with a session cut)."""
        loop = asyncio.get_running_loop()
        while True:
            pushes = self._pushes
            read_at = loop.time()
            try:
                status = await self.tower.status()
            except TowerConnectionError, AgentCommandError:
                status = None
            if status is not None and seen(status):
                return
            self._forget_ended(status)
            while self._pushes == pushes:
                bound = JOB_SILENCE if self.session_up() else JOB_POLL
                left = read_at + bound - loop.time()
                if left <= 0:
                    break
                self._pushed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(min(left, JOB_POLL)):
                        await self._pushed.wait()

    def _forget_ended(self, status: TowerStatus | None) -> None:
        """Drop the pushed records nobody follows any more: ended jobs, and
        active ones the tower no longer runs (their end was never pushed)."""
        running = {job.id for job in status.active_jobs} if status is not None else None
        for job_id, record in list(self._records.items()):
            if job_id in self._shown:
                continue  # a job being followed: its follower pops it
            if not record.job.state.active or (
                running is not None and job_id not in running
            ):
                self._records.pop(job_id, None)
