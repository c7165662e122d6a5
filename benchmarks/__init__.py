"""The code behind `kvpilot bench ...`: each benchmark returns a JSON-ready dict of measured figures."""
