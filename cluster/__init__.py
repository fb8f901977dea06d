"""Ray actors and scheduling for batchgen: work units in, committed unit files out.

cluster/ knows Ray and the engine's API, not the output schema or the model internals:
a job hands it a `UnitTask` (cluster/task.py) that reads and writes units.
"""
