"""batchgen jobs: the job spec, Parquet input and output, manifest and resume, the CLI.

    from jobs import run_job          # a whole job from Python (jobs/api.py)
    result = run_job("configs/demo.yaml", {"sampling.temperature": 0.7})
"""

__all__ = ["run_job", "JobResult", "load_job_spec"]


def __getattr__(name: str):
    # lazily, so `import jobs.spec` (the CLI's status/verify) stays light
    if name in __all__:
        from jobs import api

        return getattr(api, name)
    raise AttributeError(f"module 'jobs' has no attribute {name!r}")
