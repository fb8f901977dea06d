"""A node lost mid-job: ray.cluster_utils.Cluster with a head and 2 worker nodes (its own Ray,
so its own module). Each worker node hosts one GenerationWorker (custom resource "gen");
removing one while it holds units sends them back to the queue and the job completes,
every row exactly once and equal to the uninterrupted run."""
from __future__ import annotations

import os
import threading

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from conftest import stop_shared_ray  # noqa: E402

from cluster.dispatcher import run_units  # noqa: E402
from jobs.task import JobTask  # noqa: E402
from test_cluster import ROOT, assert_same_dataset, read_dataset, write_inputs  # noqa: E402
from test_faults import job_spec, prepared  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    stop_shared_ray()  # conftest.py's local instance: this module needs its own cluster
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = [c.add_node(num_cpus=1, resources={"gen": 1}) for _ in range(2)]
        c.wait_for_nodes()
        ray.init(address=c.address, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}})
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()
        # the head wrote its address to /tmp/ray/ray_current_cluster, where a later plain
        # ray.init() would try (and hang) to join the dead cluster
        marker = "/tmp/ray/ray_current_cluster"
        try:
            if open(marker).read().strip() == c.address:
                os.remove(marker)
        except OSError:
            pass


class HoldUnit(JobTask):
    """Holds unit `hold_unit` on its first attempt: after generating it, before writing it, the
    worker records its node id in `marker` and waits there (at most `hold_s` seconds) for the
    node to be removed under it. A unit on these tiny models takes milliseconds, less than a
    progress report's interval, so without holding one a removal would rarely find one."""

    def __init__(self, spec, plan, hold_unit, marker, hold_s=120.0):
        super().__init__(spec, plan)
        self.hold_unit, self.marker, self.hold_s = hold_unit, marker, hold_s

    def write_unit(self, unit, requests, outputs, tokenizer=None):
        if unit.index == self.hold_unit:
            try:  # the claim stays, so only the first attempt holds
                os.close(os.open(self.marker + ".claimed", os.O_CREAT | os.O_EXCL))
            except FileExistsError:
                pass  # a later attempt: write it as usual
            else:
                with open(self.marker + ".tmp", "w") as f:
                    f.write(ray.get_runtime_context().get_node_id())
                os.rename(self.marker + ".tmp", self.marker)  # the driver never reads it half written
                threading.Event().wait(self.hold_s)  # the node's removal ends this process
        return super().write_unit(unit, requests, outputs, tokenizer)


def test_remove_a_node_holding_units(cluster, tmp_path):
    """Unit 1's worker holds it mid-unit and its node is removed without warning: the unit (and
    any the worker prefetched) runs again on the other node's worker, and the dataset equals
    the uninterrupted run, every row once."""
    from cluster.worker import GenerationWorker
    from jobs.outputs.output_dir import OutputDir

    c, nodes = cluster
    inp = write_inputs(tmp_path / "in", sizes=(8, 8, 8))
    spec = job_spec(inp, tmp_path / "out", num_workers=2, max_unit_attempts=3)
    plan, out = prepared(spec)
    marker = str(tmp_path / "holding")
    removed = []

    def on_progress(info):
        if not removed and os.path.exists(marker):
            node_id = open(marker).read()
            c.remove_node(next(n for n in nodes if n.node_id == node_id), allow_graceful=False)
            removed.append(node_id)

    results = run_units(HoldUnit(spec, plan, 1, marker), plan.units, num_workers=2, num_cpus=1, num_gpus=0,
                        max_unit_attempts=3, on_result=None, on_progress=on_progress,
                        progress_interval_s=0.1, actor_options={"resources": {"gen": 1}})
    assert removed, "no node was removed while holding units"
    assert sorted(r.index for r in results) == [u.index for u in plan.units]
    out.cleanup_temp_files()
    assert OutputDir(str(tmp_path / "out")).verify() == []

    # the uninterrupted run, in this process
    ref_spec = job_spec(inp, tmp_path / "ref")
    ref_plan, _ = prepared(ref_spec)
    w = GenerationWorker(JobTask(ref_spec, ref_plan), "reference", num_threads=1)
    for u in ref_plan.units:
        w.run_unit(u)
    w.shutdown()
    rows = read_dataset(tmp_path / "out")
    assert len({(r["prompt_id"], r["sample_index"]) for r in rows}) == len(rows) == 48
    assert_same_dataset(rows, read_dataset(tmp_path / "ref"))
