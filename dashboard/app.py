"""`kvpilot dashboard` entrypoint: page config, access, sidebar filters, routing with st.navigation.

Run it as `kvpilot dashboard` (or `streamlit run dashboard/app.py`, which listens on loopback by
dashboard/.streamlit/config.toml); KVPILOT_DB_URL picks the database, dashboard/settings.py the rest.
Every page has a stable URL: `/overview` (also `/`), `/latency`, `/kv-memory`, `/alerts`, `/tuning`, `/targets`.
"""

from __future__ import annotations

import time

import streamlit as st
from pydantic import ValidationError

from dashboard import auth, filters, settings, timewin, ui
from dashboard.data import base

st.set_page_config(page_title="kvpilot", page_icon=":material/speed:", layout="wide")

OVERVIEW = "app_pages/overview.py"
PAGES = [
    # Streamlit serves the default page at "/" only; the hidden twin gives the overview its own /overview.
    st.Page(OVERVIEW, title="Overview", icon=":material/dashboard:", url_path="home", default=True),
    st.Page(OVERVIEW, title="Overview", icon=":material/dashboard:", url_path="overview", visibility="hidden"),
    st.Page("app_pages/latency.py", title="Latency", icon=":material/timer:", url_path="latency"),
    st.Page("app_pages/kv_memory.py", title="KV memory", icon=":material/memory:", url_path="kv-memory"),
    st.Page("app_pages/diagnosis.py", title="Diagnosis", icon=":material/troubleshoot:", url_path="diagnosis"),
    st.Page("app_pages/alerts.py", title="Alerts", icon=":material/notifications:", url_path="alerts"),
    st.Page("app_pages/tuning.py", title="Tuning", icon=":material/tune:", url_path="tuning"),
    st.Page("app_pages/targets.py", title="Targets", icon=":material/lan:", url_path="targets"),
    # New pages (a diagnosis page is planned) go here, each with its own url_path.
]

page = st.navigation(PAGES)
try:
    config = settings.load()
except ValidationError as exc:
    st.error(f"**The dashboard settings are not usable.** {exc}", icon=":material/settings:")
    st.stop()
access = auth.access(config)
st.session_state[auth.ACCESS_KEY] = access
if not auth.gate_reads(config, access):
    st.stop()
url = base.db_url()
problem = base.schema_problem(url)
if problem:
    st.title(page.title)
    st.error(f"**The dashboard cannot read its database.** {problem}", icon=":material/database:")
    st.stop()

with ui.guarded("Filters"):
    resolved = filters.sidebar(url)
    auth.sidebar(config, access)
    if resolved is not None:
        selection, window = resolved
        st.session_state[ui.FILTERS_KEY] = selection
        st.session_state[ui.WINDOW_KEY] = window.describe()
        st.session_state[ui.LIVE_KEY] = window.label != timewin.CUSTOM
        st.session_state["kvpilot_full_run_at"] = time.time()
        page.run()

interval = filters.refresh_interval_s()
if interval:

    @st.fragment(run_every=interval)
    def _auto_refresh() -> None:
        # The fragment also runs with every full run; only a timer tick (a full interval later) reruns the app.
        if time.time() - st.session_state.get("kvpilot_full_run_at", 0.0) >= interval * 0.9:
            st.rerun(scope="app")

    _auto_refresh()
