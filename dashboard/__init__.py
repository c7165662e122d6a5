"""The Streamlit dashboard: `kvpilot dashboard`. Reads through collector.queries; writes only proposal status and
silences (docs/architecture.md)."""
