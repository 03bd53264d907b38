"""The pieces of ``scripts/gpu_check.py``: its children (``runner``), its parts (``parts``), the
figures read from the benches' outputs (``figures``) and the report (``report``). Standard
library only: the check runs in whatever Python a GPU machine has."""
