"""Planning a job: its units and its fingerprint, before any work; `batchgen plan`."""
