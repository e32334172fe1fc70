"""Contexts and known wrong answers of chapter 3's exercises (``workbench/labs/ch03_probes_and_logs.py``): probes and logs."""

from lab_contexts.common import MEMORY, STEPS

CONTEXTS: dict = {"3.1": {"memory": MEMORY}, "3.2": {"steps": STEPS}}
WRONG: dict = {
    "3.1": [MEMORY["kv_budget_bytes"], MEMORY["num_blocks"]],
    "3.2": [lambda s: s["reservation"] + s["internal_fragmentation"] + s["external_fragmentation"]],
}
