"""The config flow's guided install: an administrator's login on the tower
(from its form, never stored), what the tower has, the install's plan, and
the texts its forms show.

GuidedInstall holds the login from a login that works to the install, never
longer; the functions here take it as an argument and keep nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager
import dataclasses
from datetime import datetime
from typing import Any, Final

from homeassistant.const import CONF_HOST, CONF_PORT, CONF_USERNAME
from homeassistant.core import CALLBACK_TYPE, HomeAssistant, callback
from homeassistant.helpers.event import async_call_later

from .const import (
    CONF_ADMIN_KEY,
    CONF_ADMIN_PASSPHRASE,
    CONF_ADMIN_PASSWORD,
    CONF_ADMIN_USERNAME,
    CONF_GAMING_VMS,
    CONF_GPU_NODE,
    CONF_HOST_KEY,
    CONF_LIBVIRT_URI,
    CONF_RESTART_LIBVIRT,
    CONF_SUDO_PASSWORD,
    DEFAULT_LIBVIRT_URI,
)
from .installer import (
    Account,
    AdminLogin,
    AdminSession,
    InstallError,
    InstallPlan,
    InstallReport,
    Survey,
    admin_session,
)
from .tower.gpu_handoff import wire
from .tower_client import fingerprint

# How long the guided install keeps a working administrator login for the
# install: enough to pick the VMs and read the plan.
ADMIN_LOGIN_KEPT: Final = 600.0


def tower_admin_session(
    data: Mapping[str, Any], login: AdminLogin
) -> AbstractAsyncContextManager[AdminSession]:
    """An administrator's session on the tower of this entry data (its
    address and pinned host key)."""
    return admin_session(data[CONF_HOST], data[CONF_PORT], data[CONF_HOST_KEY], login)


def admin_login(user_input: dict[str, Any]) -> AdminLogin:
    """The login a form gave (blank fields are not given)."""
    key = str(user_input.get(CONF_ADMIN_KEY) or "").strip()
    return AdminLogin(
        username=str(user_input[CONF_ADMIN_USERNAME]).strip(),
        password=user_input.get(CONF_ADMIN_PASSWORD) or None,
        private_key=f"{key}\n" if key else None,
        passphrase=user_input.get(CONF_ADMIN_PASSPHRASE) or None,
        sudo_password=user_input.get(CONF_SUDO_PASSWORD) or None,
    )


def public_fields(user_input: dict[str, Any] | None) -> dict[str, Any]:
    """What a form may show again: never a password or a key."""
    secret = {
        CONF_ADMIN_PASSWORD,
        CONF_ADMIN_KEY,
        CONF_ADMIN_PASSPHRASE,
        CONF_SUDO_PASSWORD,
    }
    return {
        key: value for key, value in (user_input or {}).items() if key not in secret
    }


def install_error_placeholders(err: InstallError) -> dict[str, str]:
    """The tower's words and what it left, for the error's text."""
    return {
        "detail": err.detail or "-",
        "left": ", ".join(err.left) or "-",
    }


def login_placeholders(
    data: Mapping[str, Any], err: InstallError | None
) -> dict[str, str]:
    """The login form's texts: the tower, its pinned host key's fingerprint
    (to compare with the tower's before typing a password), the account Home
    Assistant will log in as, and why the last try failed (``-``: it did
    not)."""
    return {
        "host": data[CONF_HOST],
        "fingerprint": fingerprint(data[CONF_HOST_KEY]),
        "user": data[CONF_USERNAME],
    } | (install_error_placeholders(err) if err else {"detail": "-", "left": "-"})


def survey_placeholders(host: str, survey: Survey) -> dict[str, str]:
    """The options form's texts: what the tower has."""
    return {
        "host": host,
        "python": survey.python,
        "agent": survey.agent_version or "-",
        "left_out": ", ".join(survey.left_out) or "-",
    }


def plan_placeholders(
    host: str, admin: str, plan: InstallPlan, account: Account | None
) -> dict[str, str]:
    """The confirmation's texts: exactly what the install does, and what the
    account for Home Assistant is now if it exists (the step that says so)."""
    texts = {
        "host": host,
        "admin": admin,
        "user": plan.user,
        "gpu_node": plan.gpu_node,
        "gaming": ", ".join(plan.gaming),
        "uri": plan.uri,
        "version": wire.VERSION,
    }
    if account is None:
        return texts
    return texts | {
        "groups": " ".join(account.groups) or "-",
        "shell": account.shell or "-",
        "password": account.password,
        "home": f"{account.home} ({account.home_mode})",
    }


class GuidedInstall:
    """One guided install, from the administrator's login to the install's
    report. The login is kept from a login that works to the install, never
    longer, and at most ADMIN_LOGIN_KEPT: installing forgets it whatever
    happens (a retry asks for it again), and so do ``forget`` (a flow closed
    half way) and the time limit (a browser tab closed half way leaves the
    flow open until Home Assistant restarts)."""

    def __init__(self) -> None:
        """Nothing known yet."""
        self.admin: AdminLogin | None = None
        self.survey: Survey | None = None
        self.uri = DEFAULT_LIBVIRT_URI
        self.plan: InstallPlan | None = None
        self.report: InstallReport | None = None
        self._expiry: CALLBACK_TYPE | None = None

    def forget(self) -> None:
        """Drop the administrator login."""
        if self._expiry is not None:
            self._expiry()
            self._expiry = None
        self.admin = None

    @callback
    def _expired(self, _now: datetime) -> None:
        self._expiry = None
        self.admin = None

    async def log_in(
        self,
        hass: HomeAssistant,
        data: Mapping[str, Any],
        user_input: dict[str, Any],
    ) -> InstallError | None:
        """Survey the tower of ``data`` (its address and pinned key, the
        account Home Assistant will log in as) with the login form's login,
        kept if it works (ADMIN_LOGIN_KEPT at most); else why it failed.
        Looking changes nothing."""
        login = admin_login(user_input)
        self.uri = str(user_input[CONF_LIBVIRT_URI]).strip()
        try:
            async with tower_admin_session(data, login) as session:
                self.survey = await session.survey(data[CONF_USERNAME], self.uri)
        except InstallError as err:
            return err
        self.forget()
        self.admin = login
        self._expiry = async_call_later(hass, ADMIN_LOGIN_KEPT, self._expired)
        return None

    @property
    def known_survey(self) -> Survey:
        """What the tower has (the steps run in order)."""
        if self.survey is None:  # pragma: no cover - a step out of order
            raise RuntimeError("the tower has not been surveyed yet")
        return self.survey

    def choose(self, user: str, user_input: dict[str, Any]) -> bool:
        """Plan the install of the options picked (False: no gaming VM
        besides the GPU node). Its key and libvirtd's restart come with the
        confirmation."""
        gpu_node = str(user_input[CONF_GPU_NODE])
        gaming = [name for name in user_input[CONF_GAMING_VMS] if name != gpu_node]
        if not gaming:
            return False
        self.plan = InstallPlan(
            user=user,
            gpu_node=gpu_node,
            gaming=gaming,
            uri=self.uri,
            public_key="",
            restart_libvirt=False,
            replace_config=self.known_survey.config_exists,
        )
        return True

    async def install(
        self, data: Mapping[str, Any], public_key: str, user_input: dict[str, Any]
    ) -> InstallReport:
        """Install as planned and confirmed: with Home Assistant's public key,
        restarting libvirtd if ticked. The login is forgotten whatever
        happens. Raises InstallError."""
        login = self.admin
        self.forget()
        if self.plan is None or login is None:  # pragma: no cover - order
            raise RuntimeError("nothing to install yet")
        plan = dataclasses.replace(
            self.plan,
            public_key=public_key,
            restart_libvirt=bool(user_input[CONF_RESTART_LIBVIRT]),
        )
        try:
            async with tower_admin_session(data, login) as session:
                report = await session.install(plan, self.known_survey)
                self.report = report
        finally:
            del login
        return report


def retry_fields(plan: InstallPlan, login: AdminLogin) -> dict[str, Any]:
    """What the login form shows again after a failed install."""
    return {
        CONF_USERNAME: plan.user,
        CONF_ADMIN_USERNAME: login.username,
        CONF_LIBVIRT_URI: plan.uri,
    }
