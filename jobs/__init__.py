"""batchgen jobs: the job spec, Parquet input and output, manifest and resume, the CLI."""
