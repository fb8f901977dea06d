import sys
from pathlib import Path

# tests import the stand-in models in tests/toy.py as `toy`
sys.path.insert(0, str(Path(__file__).parent))
# and the project's packages (engine, cluster, jobs) from this checkout, installed or not
if str(Path(__file__).parents[1]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).parents[1]))

import os  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray instance (2 CPUs) shared by the test modules that ask for it: started by the
    first, kept for the next (a start costs 5-10 s on 2 cores), shut down at the end of the
    session. A module that needs Ray otherwise (test_multinode.py's cluster, test_submit.py's
    head, whose dashboard agent would find the ports of this instance's agent taken) calls
    stop_shared_ray() first; the next module that asks starts it again. Workers find engine/, cluster/,
    jobs/ and tests/ (toy models, fault injectors) on their PYTHONPATH."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}})
    yield


@pytest.fixture(scope="session", autouse=True)
def _ray_shutdown_at_exit():
    yield
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()


def stop_shared_ray() -> None:
    """Shut down the shared local instance of `ray_local`, if it runs in this process."""
    if "ray" in sys.modules:
        import ray

        if ray.is_initialized():
            ray.shutdown()
