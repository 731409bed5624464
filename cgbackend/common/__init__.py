"""What every layer of cgbackend shares and nothing else: FX node helpers (fx_utils.py), operator
names (op_names.py), why something runs eagerly (reasons.py), the warning categories (notices.py),
the logger's registration with torch (logs.py), the progress log of long compiles (progress.py)
and the torch build in words (machine.py). Modules here import no other part of cgbackend."""
