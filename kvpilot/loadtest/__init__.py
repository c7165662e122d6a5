"""`kvpilot loadtest`: an open-loop HTTP load generator with pass criteria, cold-start and fault checks.

plan (what to send and when) -> runner (send it, scrape the target's /metrics) -> analysis (criteria,
windows, the report). local starts engines/collectors for --quick, --cold-start and --fault; faults
orchestrates one fault and checks that nothing was lost.
"""
