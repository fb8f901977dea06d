"""A job's output directory: unit commits, the manifest, status and verify, the lease.

- layout.py: the names in the directory (part files, manifest, lease, _SUCCESS);
- schema.py: what an output row is (its columns, an openai_batch job's columns) and the
  metadata every part file carries;
- commit.py: writing files whole: a unit's part file committed once (first commit wins: a
  local hard link, a conditional PUT (If-None-Match) on S3, else a check and one PUT),
  small files replaced whole;
- output_dir.py: OutputDir: prepare (new, resume, or another job's output refused), the
  manifest, the success marker, status; verify.py: verify against the manifest;
- lease.py: one driver at a time per output directory (judged by watching the lease);
- batch_responses.py: an openai_batch job's choice column and its response JSONL file.

outputs/ reads and writes the directory only: it never imports inputs/, plan/ or the job
runner, nor cluster/.
"""
