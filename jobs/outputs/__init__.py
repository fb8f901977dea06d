"""A job's output directory: unit commits, the manifest, status and verify, the lease."""
