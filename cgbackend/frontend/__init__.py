"""What runs before Dynamo traces a model: its preparation for every entry point (prepare.py:
opaque modules, static dispatch's loop rewrites and expert layout, layer stacks), the stacks of
identical layers compiled once each (regional.py), Dynamo's data-dependent-op settings scoped to a
call (tracing.py), the user's marks (marks.py) and capturing a served model's sizes ahead of
traffic (warm_up.py)."""
