"""Who may read and who may write: the dashboard's authentication, checked once per browser session.

The dashboard writes two things, silences and proposal decisions (docs/architecture.md: administration needs a
credential); everything else is reading. The rules:

- Reads are open while Streamlit listens on loopback only (the default: dashboard/.streamlit/config.toml,
  `kvpilot dashboard --host 127.0.0.1`). On any other address every page needs a signed-in user, and
  without a write password configured the dashboard refuses to show anything.
- Writes always need a signed-in user, one of:
  * `KVPILOT_DASHBOARD_PASSWORD` (12+ characters): a visitor signs in once per session with their name
    and the password (compared with hmac.compare_digest). Repeated failures lock sign-in for that
    client only, and wrong guesses from all clients together are held to a rate
    (dashboard/signin_guard.py). A client is its address (`st.context.ip_address`; behind a reverse
    proxy on this host, the `KVPILOT_DASHBOARD_CLIENT_ADDRESS_HEADER` it sets, trusted on loopback only,
    as anyone elsewhere could forge it), else its browser session.
    The name is what silences record as their author.
  * `KVPILOT_DASHBOARD_TRUST_PROXY_HEADER=X-Forwarded-User`: a reverse proxy on this host (oauth2-proxy,
    an SSO gateway) authenticated the visitor and names them in that header. Trusted only while the
    dashboard listens on loopback, where nobody but that proxy can reach it; on another address the
    header is ignored and the password is needed.
  * Neither: the dashboard is read-only and says how to enable changes.

Streamlit's own `st.login` (OIDC) would need an identity provider; a proxy in front gives the same.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

import streamlit as st

from dashboard import settings as settings_mod
from dashboard.signin_guard import GuardLimits, SignInGuard
from plumbing.bind import is_loopback

USER_KEY = "kvpilot_user"
CLIENT_KEY = "kvpilot_client"
MAX_FAILURES = GuardLimits().per_client
MAX_NAME = 64
# What a user name may hold: it is shown (Markdown) and stored as a silence's author.
USER_NAME = re.compile(r"[\w][\w .@+-]{0,63}")


def bind_address() -> str | None:
    """The address Streamlit listens on (None or '' means every interface)."""
    return st.get_option("server.address")


def request_headers() -> Mapping[str, str]:
    """The headers of the browser session's first request (what a reverse proxy set)."""
    try:
        return st.context.headers
    except Exception:  # outside a session (bare mode)
        return {}


@dataclass(frozen=True)
class Access:
    """What this session may do, and why not when it may not."""

    mode: str | None  # 'proxy', 'password' or None (read-only dashboard)
    loopback: bool
    user: str | None

    @property
    def can_write(self) -> bool:
        return self.user is not None

    @property
    def can_read(self) -> bool:
        return self.loopback or self.user is not None


def write_mode(cfg: settings_mod.DashboardSettings, loopback: bool) -> str | None:
    if cfg.trust_proxy_header and loopback:
        return "proxy"
    if cfg.password is not None:
        return "password"
    return None


def _proxy_user(cfg: settings_mod.DashboardSettings) -> str | None:
    assert cfg.trust_proxy_header is not None
    value = (request_headers().get(cfg.trust_proxy_header) or "").strip()
    return value if USER_NAME.fullmatch(value) else None


def access(cfg: settings_mod.DashboardSettings | None = None) -> Access:
    cfg = cfg or settings_mod.load()
    loopback = is_loopback(bind_address())
    mode = write_mode(cfg, loopback)
    user = None
    if mode == "proxy":
        user = _proxy_user(cfg)
    elif mode == "password":
        user = st.session_state.get(USER_KEY)
    return Access(mode, loopback, user)


FAILURES = SignInGuard()


def client_address() -> str | None:
    """The peer's address as Streamlit saw it (None for a loopback peer, or outside a session)."""
    try:
        return st.context.ip_address
    except Exception:  # outside a session (bare mode)
        return None


def _client_of(address: str) -> str | None:
    """An address as a client: IPv6 by its /64 (one host holds all of it), None if not an address."""
    try:
        ip = ipaddress.ip_address(address.strip().strip("[]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return f"address {ip.ipv4_mapped}"
        return f"address {ipaddress.ip_network(f'{ip}/64', strict=False)}"
    return f"address {ip}"


def client_key(cfg: settings_mod.DashboardSettings) -> str:
    """Whom a wrong password counts against: the client's address, else this browser session.

    The proxy's header is read only while the dashboard listens on loopback: there only that proxy
    reaches it; elsewhere a visitor could name any address in it and never be locked."""
    if cfg.client_address_header and is_loopback(bind_address()):
        hops = (request_headers().get(cfg.client_address_header) or "").split(",")
        forwarded = _client_of(hops[-1])  # what the proxy on this host appended
        if forwarded is not None:
            return forwarded
    address = client_address()
    client = _client_of(address) if address else None
    if client is not None:
        return client
    if CLIENT_KEY not in st.session_state:
        st.session_state[CLIENT_KEY] = secrets.token_hex(8)
    return f"session {st.session_state[CLIENT_KEY]}"


def check_password(cfg: settings_mod.DashboardSettings, name: str, password: str, *, client: str) -> str:
    """The signed-in name, or ValueError saying why not. Constant-time comparison of the password;
    wrong ones count against `client` (and all clients together, `FAILURES`)."""
    if cfg.password is None:
        raise ValueError("sign-in is not configured (KVPILOT_DASHBOARD_PASSWORD)")
    FAILURES.before_check(client)  # SignInRefused is a ValueError saying how long to wait
    name = name.strip()
    good = hmac.compare_digest(password.encode(), cfg.password.get_secret_value().encode())
    if not good:
        FAILURES.failed(client)
        raise ValueError("wrong password")
    FAILURES.succeeded(client)
    if not USER_NAME.fullmatch(name):
        raise ValueError(
            f"give your name (1 to {MAX_NAME} letters, digits, spaces or . @ + -): silences record who created them"
        )
    return name


def sign_in_form(cfg: settings_mod.DashboardSettings, *, where: st.delta_generator.DeltaGenerator) -> None:
    """Name and password, checked once; the session stays signed in until it ends or signs out."""
    with where.form("kvpilot_sign_in", clear_on_submit=True):
        name = st.text_input("Your name", key="auth_name", max_chars=MAX_NAME)
        password = st.text_input("Password", type="password", key="auth_password")
        if st.form_submit_button("Sign in", icon=":material/login:"):
            try:
                st.session_state[USER_KEY] = check_password(cfg, name, password, client=client_key(cfg))
            except ValueError as exc:
                st.error(f"Not signed in: {exc}.")
            else:
                st.rerun()


HOW_TO_ENABLE = (
    "Changes (silences, proposal decisions) need a signed-in user: set `KVPILOT_DASHBOARD_PASSWORD`, or "
    "serve the dashboard behind an authenticating proxy with `KVPILOT_DASHBOARD_TRUST_PROXY_HEADER`."
)


def sidebar(cfg: settings_mod.DashboardSettings, acc: Access) -> None:
    """Who is signed in, a sign-in form, or why changes are off."""
    side = st.sidebar
    if acc.user is not None:
        how = "via your proxy" if acc.mode == "proxy" else "for this session"
        side.caption(f"Signed in as **{acc.user}** ({how}).")
        if acc.mode == "password" and side.button("Sign out", key="auth_sign_out", icon=":material/logout:"):
            st.session_state.pop(USER_KEY, None)
            st.rerun()
    elif acc.mode == "password":
        with side.expander("Sign in to make changes", icon=":material/lock:"):
            sign_in_form(cfg, where=st)
    elif acc.mode == "proxy":
        side.caption(f"Read-only: your proxy sent no `{cfg.trust_proxy_header}` header.")
    else:
        side.caption("Read-only dashboard. " + HOW_TO_ENABLE)


def gate_reads(cfg: settings_mod.DashboardSettings, acc: Access) -> bool:
    """False (with the reason shown) when this session may not see the pages."""
    if acc.can_read:
        return True
    address = bind_address() or "every interface"
    if acc.mode is None:
        st.error(
            f"**The dashboard listens on {address} without a password, so it shows nothing.** Listen on "
            "loopback (`kvpilot dashboard`, or `--server.address 127.0.0.1`), or set "
            "`KVPILOT_DASHBOARD_PASSWORD` to require signing in.",
            icon=":material/lock:",
        )
        return False
    st.info(f"This dashboard listens on {address}: sign in to see it.", icon=":material/lock:")
    sign_in_form(cfg, where=st.container())
    return False


ACCESS_KEY = "kvpilot_access"


def current() -> Access:
    """What app.py resolved for this run (read-only when a page runs outside the app)."""
    return st.session_state.get(ACCESS_KEY) or Access(None, False, None)


def writer() -> str | None:
    """The signed-in user a write is recorded under, or None: pages then disable their write controls."""
    return current().user


def need_writer(action: str) -> None:
    """In place of a write control: how to become someone who may do this."""
    mode = current().mode
    if mode == "password":
        st.caption(f"Sign in (sidebar) to {action}.")
    elif mode == "proxy":
        st.caption(f"To {action}, open the dashboard through the authenticating proxy.")
    else:
        st.caption(f"Read-only dashboard: to {action}, sign in. " + HOW_TO_ENABLE)
