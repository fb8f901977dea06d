"""Fresh noise by default in a GenerationPool; an explicit seed reproduces a call exactly.

A sample's noise is keyed by (seed, prompt id, sample index). A pool call without an explicit
seed gets its own seed from the config's and the pool's call count (jobs.pool_task.call_seed),
recorded in the rows' `seed` column; `run_job` (JobTask) never gets a call count.
"""
from __future__ import annotations

import pytest

from conftest import same_rows

PROMPTS = ["What is 2 + 2?", "Name a prime.", "abc"]
CONFIG = {"model": {"path": "tiny-random", "max_num_seqs": 16, "max_seq_len": 64},
          "sampling": {"num_samples": 4, "max_tokens": 8, "seed": 5}}


def test_call_params_mix_the_call_number_only_without_an_explicit_seed():
    """No seed: each call number its own seed (the same in every run); an explicit seed, a
    SamplingParams, or no call number (how a job's params are made) keep the seed as given."""
    from engine import SamplingParams
    from jobs.config import load_job_spec
    from jobs.pool_task import PoolTask, call_seed

    task = PoolTask(load_job_spec(CONFIG))
    seeds = [task.call_params(None, call_number=n).seed for n in range(3)]
    assert seeds == [call_seed(5, n) for n in range(3)] and len(set(seeds) | {5}) == 4
    assert task.call_params({"temperature": 0.5}, call_number=1).seed == call_seed(5, 1)
    assert task.call_params({"seed": 5}, call_number=1).seed == 5
    assert task.call_params({"sampling.seed": 9}, call_number=7).seed == 9
    assert task.call_params(None).seed == 5 == task.params.seed
    sp = SamplingParams(seed=0)
    assert task.call_params(sp, call_number=3) is sp
    assert call_seed(5, 0) != call_seed(6, 0) and 0 <= call_seed(5, 0) < 2**63


def test_call_params_of_an_openai_batch_config_keep_its_defaults():
    """A call's sampling keys are validated over the keys the config gave, not over a dump
    with defaults filled in: an openai_batch config (whose dump holds the input.column it
    refuses) takes them, and keeps OpenAI's defaults (top_k off) under them."""
    from jobs.config import load_job_spec
    from jobs.pool_task import PoolTask

    task = PoolTask(load_job_spec({**CONFIG, "input": {"format": "openai_batch"}}))
    params = task.call_params({"temperature": 0.5})
    assert params.temperature == 0.5 and params.top_k == task.params.top_k == 0


@pytest.fixture(scope="module")
def pool(ray_local):
    from jobs import GenerationPool

    with GenerationPool(CONFIG, {"cluster.num_workers": 1}) as p:
        yield p


def _samples(table):
    return table.select(["prompt_id", "sample_index", "tokens", "logprobs", "seed"]).to_pylist()


def test_two_calls_without_a_seed_differ_and_a_seed_reproduces_a_call(pool):
    """Same prompts and ids, no seed: the second call's samples differ from the first's; the
    first call's `seed` column given back reproduces it bit for bit (at call number 3); the
    same explicit seed twice gives identical rows."""
    first, second = pool.generate(PROMPTS), pool.generate(PROMPTS)
    assert [r["tokens"] for r in _samples(first)] != [r["tokens"] for r in _samples(second)]
    (s1,), (s2,) = set(first.column("seed").to_pylist()), set(second.column("seed").to_pylist())
    assert s1 != s2
    assert same_rows(pool.generate(PROMPTS, {"seed": s1})) == same_rows(first)
    a, b = pool.generate(PROMPTS, {"seed": 11}), pool.generate(PROMPTS, {"seed": 11})
    assert same_rows(a) == same_rows(b) and set(a.column("seed").to_pylist()) == {11}
