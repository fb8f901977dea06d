"""batchgen jobs: the job spec, Parquet input and output, manifest and resume, the CLI.

    from jobs import run_job          # a whole job from Python (jobs/api.py)
    result = run_job("configs/demo.yaml", {"sampling.temperature": 0.7})

    from jobs import GenerationPool   # workers kept alive across calls (jobs/pool.py)
"""

__all__ = ["run_job", "JobResult", "load_job_spec", "GenerationPool"]


def __getattr__(name: str):
    # lazily, so `import jobs.spec` (the CLI's status/verify) stays light
    if name == "GenerationPool":
        from jobs.pool import GenerationPool

        return GenerationPool
    if name in __all__:
        from jobs import api

        return getattr(api, name)
    raise AttributeError(f"module 'jobs' has no attribute {name!r}")
