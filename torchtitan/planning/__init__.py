"""Plan a job at cluster scale on one CPU: a dry run of the real trainer at any world size on fake
tensors (``dry_run``), its memory, traffic and work per rank, and a step-time model for a named
cluster (``cost``, ``clusters``); ``scripts/plan.py`` is the command line, docs/planning.md the guide."""
