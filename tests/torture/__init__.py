"""Torture checks: hostile input and broken upstreams against a live host (``make
torture``, ``python -m tests.torture``; reduced inside ``make test``). See conftest.py and
docs/OPERATIONS.md, "Torture"."""
