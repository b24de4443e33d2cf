"""The named mutants: safety-critical behaviour broken on purpose, one at a time.

Each mutant is a small textual patch (exact text, found exactly once, replaced)
of a product file, and the tests that should notice it. ``scripts/mutants``
applies each to a scratch copy of the repository and runs those tests there: a
mutant whose tests all pass survived, and that fails the run. A patch whose
text is no longer in the file fails too (the code moved on: update the
mutant). mutmut is not used: its mutants are random operator flips, these are
breakages of named promises, and the pinned tool chain does not carry it.
"""

from __future__ import annotations

from dataclasses import dataclass

# The tower agent's package, and its modules the mutants patch.
AGENT = "custom_components/gpu_handoff/tower/gpu_handoff"
AGENT_ACCOUNTS = f"{AGENT}/accounts.py"
AGENT_JOBS = f"{AGENT}/jobs.py"
AGENT_REQUESTS = f"{AGENT}/requests.py"
AGENT_RUNNER = f"{AGENT}/runner.py"
AGENT_VIRSH = f"{AGENT}/virsh.py"
AGENT_WIRE = f"{AGENT}/wire.py"
RUNNER = "custom_components/gpu_handoff/runner.py"
NODE_RETURN = "custom_components/gpu_handoff/node_return.py"
CONTROLLER = "custom_components/gpu_handoff/controller.py"
OPERATIONS = "custom_components/gpu_handoff/operations.py"
CORE = "custom_components/gpu_handoff/core.py"
COORDINATOR = "custom_components/gpu_handoff/coordinator.py"
CLUSTER = "custom_components/gpu_handoff/cluster_client.py"
DRAIN = "custom_components/gpu_handoff/drain.py"
CLUSTER_EVENTS = "custom_components/gpu_handoff/cluster_events.py"
CONFIG_FLOW = "custom_components/gpu_handoff/config_flow.py"
CONFIG_FLOW_INSTALL = "custom_components/gpu_handoff/config_flow_install.py"
SENSOR = "custom_components/gpu_handoff/sensor.py"
INSTALLER = "custom_components/gpu_handoff/installer.py"
TOWER_CLIENT = "custom_components/gpu_handoff/tower_client.py"
GUIDED = "tests/test_guided_install.py"


@dataclass(frozen=True)
class Patch:
    """Replace ``old`` (present exactly once in ``path``) with ``new``."""

    path: str
    old: str
    new: str


@dataclass(frozen=True)
class Mutant:
    """A breakage of ``promise``, and the tests that must notice it."""

    name: str
    promise: str
    patches: tuple[Patch, ...]
    tests: tuple[str, ...]
    ci: bool = False  # among the handful CI runs (fast killers)


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "no_uncordon_after_return",
        "the return lifts GPU Handoff's own cordon once the node is Ready",
        (
            Patch(
                NODE_RETURN,
                "        lifted = await self.cluster.uncordon(self.k8s_node)\n",
                "        lifted = False\n",
            ),
        ),
        (
            "tests/test_cluster_promise.py::test_a_cordon_placed_during_a_handoff_is_kept_by_the_return",
        ),
    ),
    Mutant(
        "stop_before_guest_agent",
        "no stop is sent before the guest's agent answers",
        (
            Patch(
                AGENT_RUNNER,
                "            if self.agent_ready(domain):\n",
                "            if True:\n",
            ),
        ),
        ("tests/tower/test_jobs.py::test_agent_timeout_sends_no_stop",),
        ci=True,
    ),
    Mutant(
        "throttling_429_taken_as_success",
        "a 429 from the API server is never taken for success",
        (
            Patch(
                CLUSTER,
                "        except ApiException as err:\n"
                "            raise _api_error(err) from err\n",
                "        except ApiException as err:\n"
                "            if err.status == HTTP_TOO_MANY_REQUESTS:\n"
                "                return None\n"
                "            raise _api_error(err) from err\n",
            ),
        ),
        (
            "tests/test_cluster_client.py::test_a_throttled_cordon_is_retried_not_taken_for_a_budget",
            "tests/test_cluster_client.py::test_drain_refused_by_a_pdb_until_the_timeout",
        ),
        ci=True,
    ),
    Mutant(
        "no_domain_check_in_serve",
        "the forced command refuses a job for a domain it does not manage",
        (
            Patch(
                AGENT_REQUESTS,
                "    if verb in JOB_VERBS:\n"
                "        check_work(cfg, verb, args[0] if args else None)\n",
                "    if False:\n"
                "        check_work(cfg, verb, args[0] if args else None)\n",
            ),
        ),
        ("tests/tower/test_serve.py::test_rejected_without_side_effect",),
        ci=True,
    ),
    Mutant(
        "noop_job_lock",
        "jobs run one at a time per tower",
        (
            Patch(
                AGENT_RUNNER,
                "fcntl.flock(tower, fcntl.LOCK_EX)",
                "fcntl.flock(tower, fcntl.LOCK_UN)",
            ),
        ),
        (
            "tests/tower/test_jobs.py::test_jobs_wait_for_tower_lock",
            "tests/tower/test_jobs.py::test_two_handoffs_at_once_detached",
        ),
        ci=True,
    ),
    Mutant(
        "second_job_for_a_request_id",
        "the tower never runs two jobs for one request id",
        (
            Patch(
                AGENT_JOBS,
                "existing = find_request(cfg, request_id)",
                "existing = None",
            ),
        ),
        ("tests/tower/test_requests.py::test_same_request_id_is_one_job",),
    ),
    Mutant(
        "no_resume_of_the_stored_job",
        "after a restart mid-operation, the stored tower job is followed",
        (
            Patch(
                CONTROLLER,
                "self._spawn(self._run(request, resume=True))",
                "self._spawn(self._run(request, resume=False))",
            ),
        ),
        ("tests/test_session_moments.py::test_a_restart_mid_job_follows_the_same_job",),
    ),
    Mutant(
        "rollback_under_a_running_job",
        "the cordon is never lifted while a tower job may still stop the node",
        (
            Patch(
                RUNNER,
                "    if not gpu_node_undisturbed(await tower.status()):\n",
                "    status = await tower.status()\n"
                "    gpu = status.domains.get(status.gpu_node)\n"
                "    if gpu is None or gpu.state != RUNNING:\n",
            ),
        ),
        (
            "tests/test_session_moments.py::test_a_lost_reply_is_looked_up_not_sent_twice",
            "tests/chaos/test_harness.py::test_no_rollback_under_the_hooks_stop_job",
            "tests/test_cluster_promise.py::test_removing_the_entry_while_its_job_stops_the_gpu_node",
        ),
    ),
    Mutant(
        "stuck_after_an_unexpected_error",
        "an error of any kind ends the operation (never stuck)",
        (
            Patch(
                OPERATIONS,
                "        except Exception as err:  # noqa: BLE001 - every "
                "failure must end the operation\n",
                "        except (HomeAssistantError, TowerError, ClusterError) "
                "as err:\n",
            ),
        ),
        (
            "tests/test_cluster_promise.py::test_an_unexpected_error_ends_the_handoff_cleanly",
        ),
    ),
    Mutant(
        "host_key_repinned_on_reconfigure",
        "reconfigure at the same address never re-pins a changed host key",
        (
            Patch(
                CONFIG_FLOW,
                "    ):\n        return data, None, {}\n",
                "    ):\n"
                "        data[CONF_HOST_KEY] = await fetch_host_key(\n"
                "            tower[CONF_HOST], tower[CONF_PORT]\n"
                "        )\n"
                "        return data, None, {}\n",
            ),
        ),
        (
            "tests/test_config_flow.py::test_reconfigure_same_address_never_repins_a_changed_host_key",
        ),
    ),
    Mutant(
        "reconfigure_drops_the_new_user",
        "reconfigure stores the new user name",
        (
            Patch(
                CONFIG_FLOW,
                "data = dict(entry.data) | tower",
                "data = dict(entry.data) | "
                "{k: v for k, v in tower.items() if k != CONF_USERNAME}",
            ),
        ),
        ("tests/test_config_flow.py::test_reconfigure_same_address",),
    ),
    Mutant(
        "operator_cordon_lifted",
        "a cordon GPU Handoff did not place is never lifted",
        (
            Patch(
                CLUSTER,
                "            if CORDON_ANNOTATION not in "
                "(node.metadata.annotations or {}):\n"
                "                return False, None\n",
                "            if not (node.spec and node.spec.unschedulable) and (\n"
                "                CORDON_ANNOTATION not in "
                "(node.metadata.annotations or {})\n"
                "            ):\n"
                "                return False, None\n",
            ),
        ),
        (
            "tests/test_cluster_client.py::test_cordon_is_marked_and_uncordon_lifts_only_our_own",
        ),
        ci=True,
    ),
    Mutant(
        "unmanaged_pod_evicted",
        "a pod nothing recreates is not evicted unless the option allows it",
        (
            Patch(
                DRAIN,
                "            if owner is None and not pod_finished(pod):\n"
                "                if force:\n",
                "            if owner is None and not pod_finished(pod):\n"
                "                if True:\n",
            ),
        ),
        (
            "tests/test_cluster_client.py::test_drain_refuses_pods_that_nothing_recreates",
        ),
        ci=True,
    ),
    Mutant(
        "destroy_sent",
        "nothing is ever forced off: no destroy reaches libvirt",
        (
            Patch(
                AGENT_RUNNER,
                '                self.end(step, "failed", message)\n'
                "                raise AgentError(ERR_SHUTDOWN_TIMEOUT, message)\n",
                '                self.end(step, "failed", message)\n'
                '                self.virsh._run(["des" + "troy", domain], 30.0)\n'
                "                raise AgentError(ERR_SHUTDOWN_TIMEOUT, message)\n",
            ),
        ),
        ("tests/tower/test_safety.py::test_every_path_against_recording_virsh",),
        ci=True,
    ),
    Mutant(
        "handoff_states_never_shown",
        "the Handoff state shows draining and stopping while they happen",
        (
            Patch(SENSOR, '        return "stopping"\n', '        return "cordoned"\n'),
            Patch(SENSOR, '        return "draining"\n', '        return "cordoned"\n'),
        ),
        (
            "tests/test_cluster_promise.py::test_every_handoff_state_in_order_and_in_agreement",
        ),
    ),
    Mutant(
        "lease_age_clamped",
        "the lease age is the lease's real age",
        (
            Patch(
                CLUSTER,
                "lease_age = max(0.0, (dt.datetime.now(dt.UTC) - renewed)"
                ".total_seconds())",
                "lease_age = max(0.0, min(0.0, (dt.datetime.now(dt.UTC) - renewed)"
                ".total_seconds()))",
            ),
        ),
        ("tests/test_cluster_promise.py::test_the_lease_age_is_its_real_age",),
    ),
    Mutant(
        "no_return_after_a_failed_handoff",
        "a failed handoff that left the GPU node off (GPU Handoff stopped it) "
        "ends with the cards back",
        (
            Patch(
                RUNNER,
                "        return (\n            stopped_by_us\n",
                "        return (\n            False\n            and stopped_by_us\n",
            ),
            # The decision after the operation returns them too (a stop of
            # the GPU node by libvirt's hook read from its record).
            Patch(
                CORE,
                "    failed_handoff = request.kind.hands_over and not succeeded\n",
                "    failed_handoff = False\n",
            ),
        ),
        (
            (
                "tests/test_failed_handoff.py::"
                "test_a_handoff_that_fails_after_the_gpu_node_stopped_returns_the_cards"
            ),
        ),
    ),
    Mutant(
        "waiting_requests_forgotten_on_restart",
        "requests waiting behind a running operation survive a restart",
        (
            Patch(
                CONTROLLER,
                "for request in owned.queue:",
                "for request in ():",
            ),
        ),
        (
            (
                "tests/test_failed_handoff.py::"
                "test_a_request_waiting_behind_a_restart_is_carried_out"
            ),
        ),
    ),
    Mutant(
        "stale_cordon_mark_kept",
        "a mark of ours on a node someone uncordoned is removed, so a later "
        "operator cordon is never taken for ours",
        (
            Patch(
                CONTROLLER,
                "        if result.forget_stale_mark:\n",
                "        if False:\n",
            ),
        ),
        (
            (
                "tests/test_cluster_promise.py::"
                "test_an_operator_cordon_after_an_operator_uncordon_is_not_taken_for_ours"
            ),
        ),
    ),
    Mutant(
        "no_lending_after_a_handoff",
        "with lending on, the GPU node serves the free cards while someone plays "
        "(the lend decided with the handoff, and the net that lends on the level "
        "at the next update: either alone keeps the promise)",
        (
            Patch(
                OPERATIONS,
                "            or lends_after(\n",
                "            or False and lends_after(\n",
            ),
            Patch(
                CORE,
                "    if ask is None and _lend_falls_short(observed, found):\n",
                "    if ask is None and False:\n",
            ),
        ),
        ("tests/test_lending.py::test_one_player_leaves_the_cluster_two_cards",),
    ),
    Mutant(
        "hook_stop_outlives_the_gpu_nodes_start",
        "a hook's stop of the GPU node, once read, is over when GPU Handoff "
        "starts the GPU node after it",
        (
            Patch(
                CORE,
                "                    read.gpu_stopped_at, since\n",
                "                    read.gpu_stopped_at, None\n",
            ),
        ),
        (
            (
                "tests/test_core.py::"
                "test_a_hook_stop_read_is_over_once_gpu_handoff_started_the_gpu_node"
            ),
            "tests/explorer/test_explorer.py::test_a_fixed_race_stays_fixed",
        ),
    ),
    Mutant(
        "restarted_stop_reads_the_gpu_node_again",
        "a stop begun again after a restart keeps whether the GPU node ran when "
        "it first began: the operator's shutdown since is not undone",
        (
            Patch(
                CORE,
                "        if self.first_created is not None:\n            return self\n"
                "        return replace(self, gpu_was_running=gpu_running)\n",
                "        return replace(self, gpu_was_running=gpu_running)\n",
            ),
        ),
        (
            (
                "tests/test_core.py::"
                "test_a_stop_reads_whether_the_gpu_node_ran_once_before_its_first_job"
            ),
            "tests/explorer/test_explorer.py::test_a_fixed_race_stays_fixed",
        ),
    ),
    Mutant(
        "no_second_look_before_a_level_return",
        "a return decided because the GPU node was seen running looks again "
        "when it acts: the operator's GPU node shut down since stays off",
        (
            Patch(
                CORE,
                "                if_running=ask is Ask.LEVEL and not found.gpu_stopped_by_us,\n",
                "                if_running=False,\n",
            ),
        ),
        (
            (
                "tests/test_faithful_world.py::"
                "test_a_refused_lend_is_not_tried_on_a_gpu_node_shut_down_since"
            ),
        ),
    ),
    Mutant(
        "a_refresh_lands_with_the_tower_it_read_first",
        "a refresh keeps the status the tower pushed while it read the cluster",
        (
            Patch(
                COORDINATOR,
                "        if self._pushes != pushes and self.data is not None:\n",
                "        if False:\n",
            ),
        ),
        (
            (
                "tests/test_faithful_world.py::"
                "test_a_refresh_keeps_the_status_pushed_while_it_read_the_cluster"
            ),
        ),
    ),
    Mutant(
        "no_lending_on_the_level",
        "lending, a card freed while nobody looked (a VM started on the tower and "
        "quit during an operation) is lent once the free cards changed",
        (
            Patch(
                CORE,
                "    if ask is None and _lend_falls_short(observed, found):\n",
                "    if ask is None and False:\n",
            ),
        ),
        (
            "tests/test_core.py::test_lending_a_card_freed_unseen_is_lent",
            "tests/explorer/test_explorer.py::test_a_fixed_race_stays_fixed",
        ),
    ),
    Mutant(
        "admin_password_stored",
        "the guided install's administrator login is never stored",
        (
            Patch(
                CONFIG_FLOW_INSTALL,
                "        self.admin = login\n",
                "        self.admin = login\n"
                "        data[CONF_SUDO_PASSWORD] = login.password\n",
            ),
        ),
        (f"{GUIDED}::test_guided_install_from_nothing_to_a_working_integration",),
    ),
    Mutant(
        "admin_login_kept_after_install",
        "the flow forgets the administrator login when the install ends",
        (
            Patch(
                CONFIG_FLOW_INSTALL,
                "        login = self.admin\n        self.forget()\n",
                "        login = self.admin\n",
            ),
        ),
        (f"{GUIDED}::test_guided_install_from_nothing_to_a_working_integration",),
    ),
    Mutant(
        "failed_install_not_undone",
        "an install that fails half way leaves the tower as it was",
        (
            Patch(
                AGENT_ACCOUNTS,
                "            try:\n"
                "                action()\n"
                "            except _STEP_ERRORS:\n"
                "                left.append(what)",
                "            pass",
            ),
        ),
        (f"{GUIDED}::test_a_read_only_usr_local_leaves_the_tower_as_it_was",),
    ),
    Mutant(
        "agent_account_may_be_root",
        "the guided install never makes root the agent's account",
        (
            Patch(
                INSTALLER,
                'return USER_NAME.fullmatch(name) is not None and name != "root"',
                "return USER_NAME.fullmatch(name) is not None",
            ),
        ),
        # The tower's answer (user id 0) refuses root too: that layer is
        # the end-to-end test's; this one is the name's own check.
        ("tests/test_installer.py::test_a_plan_holds_only_the_towers_own_names",),
    ),
    Mutant(
        "admin_login_kept_without_limit",
        "the guided install keeps the administrator login ten minutes at most",
        (
            Patch(
                CONFIG_FLOW_INSTALL,
                "        self._expiry = async_call_later(hass, ADMIN_LOGIN_KEPT, "
                "self._expired)\n",
                "",
            ),
        ),
        (f"{GUIDED}::test_the_admin_login_is_kept_ten_minutes_at_most",),
    ),
    Mutant(
        "fingerprint_not_on_the_admin_step",
        "the administrator login form shows the pinned host key's fingerprint",
        (
            Patch(
                CONFIG_FLOW_INSTALL,
                '        "fingerprint": fingerprint(data[CONF_HOST_KEY]),\n',
                "",
            ),
        ),
        (f"{GUIDED}::test_the_account_and_uri_are_checked_before_anything_runs",),
    ),
    Mutant(
        "password_taken_after_pin",
        "the update repair takes no password for a day after the host key was pinned",
        (
            Patch(
                "custom_components/gpu_handoff/repairs.py",
                "        if user_input is not None and refused is not None",
                "        if False",
            ),
        ),
        (f"{GUIDED}::test_an_older_agent_is_updated_from_its_repair",),
    ),
    Mutant(
        "admin_account_reused_silently",
        "an existing administrator's account is not made the agent's",
        (
            Patch(
                INSTALLER,
                "        if admin:\n",
                "        if False:\n",
            ),
        ),
        (f"{GUIDED}::test_an_existing_account_is_looked_at_before_it_is_used",),
    ),
    Mutant(
        "x509_trusted_certs_at_default",
        "a connection to a tower trusts no X.509 CA of Home Assistant's home "
        "before the pinned key",
        (
            Patch(
                TOWER_CLIENT,
                '        "x509_trusted_certs": None,\n'
                '        "x509_trusted_cert_paths": None,\n',
                "",
            ),
        ),
        (
            (
                "tests/test_tower_client.py::"
                "test_a_tower_connection_takes_nothing_from_home_assistants_home"
            ),
        ),
    ),
    Mutant(
        "password_login_loads_home_keys",
        "a password login offers none of Home Assistant's own keys",
        (Patch(INSTALLER, "client_keys=keys or None,", "client_keys=keys,"),),
        (f"{GUIDED}::test_a_password_login_offers_no_key_of_home_assistants",),
    ),
    Mutant(
        "event_virsh_block_buffered",
        "a session on a Debian 11 tower (virsh 7.0) pushes libvirt's events "
        "as they happen",
        (
            Patch(
                AGENT_VIRSH,
                '        self.stdbuf = resolve_program("stdbuf", None, cfg)\n',
                "        self.stdbuf = None\n",
            ),
        ),
        (
            (
                "tests/box/test_bullseye_tower.py::"
                "test_a_session_pushes_libvirt_7_events_as_they_happen"
            ),
        ),
    ),
    Mutant(
        "remote_libvirt_uri_accepted",
        "the survey and install, run as root, take only this machine's libvirt",
        (
            Patch(
                AGENT_WIRE,
                "    found = LOCAL_URI_RE.fullmatch(uri)\n",
                "    return True\n",
            ),
        ),
        (
            "tests/test_installer.py::test_names_and_uris",
            "tests/tower/test_install.py::test_install_takes_only_this_machines_libvirt",
        ),
    ),
    Mutant(
        "node_events_never_posted",
        "a handoff and a return leave their trail in the node's Kubernetes events",
        (
            Patch(
                CLUSTER_EVENTS,
                "            self._queue.put_nowait(post)\n",
                "            del post\n",
            ),
        ),
        (
            (
                "tests/test_cluster_events.py::"
                "test_a_handoff_and_a_return_leave_a_readable_trail"
            ),
        ),
    ),
    Mutant(
        "event_series_never_patched",
        "a repeated event becomes a series, as client-go's recorder makes it",
        (
            Patch(
                CLUSTER_EVENTS,
                "            if seen.count > 2:\n",
                "            if seen.count > 1:\n",
            ),
        ),
        (
            (
                "tests/test_cluster_events.py::"
                "test_a_budget_refusing_again_and_again_is_one_series_naming_it"
            ),
        ),
    ),
    Mutant(
        "passing_failure_not_retried",
        "an operation that meets a failure the world heals by itself tries again",
        (
            Patch(
                OPERATIONS,
                "        if not transient(err):\n",
                "        if True:\n",
            ),
        ),
        (
            (
                "tests/test_passing_failures.py::"
                "test_a_stop_that_meets_libvirt_away_is_tried_again_and_done"
            ),
        ),
    ),
    Mutant(
        "held_card_released",
        "while cards are held for a gaming VM, a stop elsewhere does not start "
        "the GPU node on them",
        (
            Patch(
                CORE,
                "    if (\n        held\n        or _playing(",
                "    if (\n        False\n        or _playing(",
            ),
        ),
        (
            "tests/test_prepare.py::test_while_held_a_stop_elsewhere_gives_the_gpu_node_nothing",
        ),
    ),
    Mutant(
        "held_card_lent",
        "lending, the cards held for a gaming VM are not lent to the GPU node",
        (
            Patch(
                AGENT_RUNNER,
                "if name != domain and (Snapshot.holds(other) or name == keep)",
                "if name != domain and Snapshot.holds(other)",
            ),
        ),
        (
            "tests/tower/test_lend.py::test_the_cards_held_for_a_gaming_vm_are_not_lent",
            (
                "tests/test_prepare.py::"
                "test_lending_keeps_the_free_cards_lent_and_the_held_one_free"
            ),
        ),
    ),
    Mutant(
        "hold_never_expires",
        "a hold nobody uses ends on time, and the cards go back",
        (
            Patch(
                CORE,
                "        return until is None or now >= until\n",
                "        return until is None\n",
            ),
        ),
        ("tests/test_prepare.py::test_nobody_comes_the_cards_go_back",),
    ),
)


def by_name(name: str) -> Mutant:
    """The mutant called ``name``."""
    for mutant in MUTANTS:
        if mutant.name == name:
            return mutant
    raise KeyError(name)
