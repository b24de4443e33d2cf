"""virsh in the C locale, and every state it prints (issue 11, finding 6).

The agent inherited the caller's locale and virsh translates domain states
(`ausgeschaltet` on a German tower): state parsing, `wait_shut_off` and card
ownership broke. libvirt's translations are not installed here, so the
stand-in virsh (fakevirsh.py) translates as a virsh with them would.
"""

from __future__ import annotations

import pytest

from custom_components.gpu_handoff.sensor import VM_STATES
from custom_components.gpu_handoff.tower.gpu_handoff import virsh as agent_virsh, wire
from tests.tower.conftest import FakeTower

# What virsh prints for each virDomainState (tools/virsh-domain-monitor.c,
# virshDomainState: "idle" is VIR_DOMAIN_BLOCKED), and "blocked" too.
VIRSH_STATES = {
    "no state": "no_state",
    "running": "running",
    "idle": "blocked",
    "paused": "paused",
    "in shutdown": "in_shutdown",
    "shut off": "shut_off",
    "crashed": "crashed",
    "pmsuspended": "pmsuspended",
    "blocked": "blocked",
}
GERMAN = {
    "LANG": "de_DE.UTF-8",
    "LC_MESSAGES": "de_DE.UTF-8",
    "LANGUAGE": "de:en",
}


@pytest.mark.parametrize(("text", "state"), VIRSH_STATES.items())
def test_every_state_virsh_prints_is_one_home_assistant_accepts(
    text: str, state: str
) -> None:
    assert agent_virsh.parse_domstate(f"{text} (unknown)\n\n") == (state, "unknown")
    assert agent_virsh.parse_domstate(text) == (state, None)
    assert state in VM_STATES


def test_a_state_virsh_does_not_know_is_no_state() -> None:
    assert agent_virsh.parse_domstate("ausgeschaltet (heruntergefahren)") == (
        "no_state",
        "heruntergefahren",
    )
    assert set(wire.DOMAIN_STATES.values()) <= set(VM_STATES)


def test_status_reports_each_state_as_home_assistant_accepts(
    fake_tower: FakeTower,
) -> None:
    for text, state in VIRSH_STATES.items():
        fake_tower.set_domain("win-2", state=text)
        domains = {d["name"]: d for d in fake_tower.run("status").reply["domains"]}
        assert domains["win-2"]["state"] == state, text


def test_a_german_tower_reads_states_and_stops(fake_tower: FakeTower) -> None:
    fake_tower.configure(timeouts={"agent": 5, "shutdown": 5, "start": 5})
    status = fake_tower.run("status", env=GERMAN).reply
    domains = {d["name"]: d["state"] for d in status["domains"]}
    assert domains == {"gpu-node": "running", "win-1": "shut_off", "win-2": "shut_off"}
    held = {c["address"]: c["held_by"] for c in status["cards"]}
    assert held["0000:01:00.0"] == "gpu-node"
    # The runner inherits the German environment: its virsh must not.
    job_id = fake_tower.run("handoff", "win-1", env=GERMAN).reply["job"]["id"]
    job = fake_tower.wait_job(job_id)
    assert job["state"] == "succeeded", job
    assert fake_tower.load()["domains"]["win-1"]["state"] == "running"


def test_virsh_gets_the_c_locale_and_nothing_of_the_callers() -> None:
    env = agent_virsh.virsh_environment(
        {"PATH": "/bin", "LANG": "de_DE.UTF-8", "LANGUAGE": "de", "LC_TIME": "x"}
    )
    assert env == {"PATH": "/bin", "LC_ALL": "C"}
