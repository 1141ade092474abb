"""Ways to execute a whole decode step other than module by module, each planned once per batch shape: the CPU
decode plan (`decode_plan.py`, the step's kernel calls recorded by `plan_records.py` and replayed by one native
call), the MTP head's plan (`mtp_plan.py`), the draft model's chain of planned steps (`draft_chain.py`), and the
CUDA graph plan (`cuda_graph.py`), whose capture `capture_safety.py` checks first. Each is tested against the
module path (`workers/model/layers/`); `workers/executors.py` chooses one per runner.
"""
