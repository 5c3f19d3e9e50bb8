"""Subprocess workers for the crash-window and chaos tests (run with ``python -m``)."""
