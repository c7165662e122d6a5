"""Dashboard pages, routed by dashboard/app.py with st.navigation."""
