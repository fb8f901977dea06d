"""Planning a job before any work: its units, its fingerprint, `batchgen plan`.

- planner.py: plan_job (the model path checked, the input scanned by its reader from
  jobs/inputs/, the fingerprint), JobPlan, and the machine checks a job makes first;
- fingerprint.py: what identifies a job's output (the spec's fields, the input files, the
  checkpoint's content hashes, cached in the output directory);
- report.py: `batchgen plan`: the plan, the output's state and the lease, printed.

The planner asks the reader interface (jobs/inputs/reader.py) and never imports an input
format itself.
"""
