"""`from jobs import GenerationPool`: Ray workers kept alive across calls, weights swapped in place.

One local Ray instance for the module; tiny nanochat checkpoints (tests/weights_cases.py):
`base` (with its tokenizer) and `trained` (every weight moved, no tokenizer files, as a
trainer writes them). References are real jobs (`run_job`) on each checkpoint over the same
prompts (one of them an error row), with stop strings, so text, stop_reason and error rows
are compared too. The pool (2 workers):
- generate() with the job's seed given explicitly returns, bit for bit, the rows run_job wrote (every column: tokens, logprobs,
  mask, text, ...), from a table with the job's columns and from a list with prompt_ids;
- load_weights(trained) keeps the same worker processes and KV cache storage, and then
  generate() equals the job on `trained`;
- checkpoints of another architecture are refused naming the difference, and the pool's
  rows do not change;
- workers killed after a swap are replaced by workers that load the swapped weights.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ray = pytest.importorskip("ray")

import weights_cases  # noqa: E402
from conftest import same_rows  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["What is 2 + 2?", "Name a prime.", "", "Count to five", "abc", "The end of the story is"]
IDS = [f"q{i}" for i in range(len(PROMPTS))]
LEVELS = [1, 2, 3, 1, 2, 3]  # a passthrough column
SEED = {"seed": 1}  # the config's seed, given explicitly: a call without one draws fresh noise (test_fresh_noise.py)
SWAPS = ["weight_version"]  # the engine's count of weight swaps, per token: differs from a fresh job's 0


@pytest.fixture(scope="module")
def setup(tmp_path_factory, ray_local):
    """(checkpoints, job config, {checkpoint name: run_job's rows}, pool), on one Ray instance."""
    from jobs import GenerationPool, run_job

    d = tmp_path_factory.mktemp("pool")
    ck = weights_cases.build(d / "ckpt")
    pq.write_table(_table(), d / "in.parquet")
    config = {"model": {"path": str(ck["base"]), "max_num_seqs": 16, "max_seq_len": 64},
              "input": {"path": str(d / "in.parquet"), "id_column": "id", "passthrough": ["level"]},
              "output": {"path": str(d / "out-base")},
              "sampling": {"num_samples": 3, "max_tokens": 8, "top_k": 20, "seed": 1, "stop": ["e", " t"]},
              "cluster": {"unit_rows": 2}}
    jobs = {"base": run_job(config).to_table(),
            "trained": run_job(config, {"model.path": str(ck["trained"]), "model.tokenizer": str(ck["tokenizer"]),
                                        "output.path": str(d / "out-trained")}).to_table()}
    with GenerationPool(config, {"cluster.num_workers": 2}) as pool:  # the shared local Ray (conftest.py)
        yield ck, config, jobs, pool


def _table():
    return pa.table({"id": IDS, "prompt": PROMPTS, "level": LEVELS})


def _rows(table, drop=()):
    """A job's or a call's rows; an error row names where its prompt came from ("in.parquet row
    2" in a job, "prompts row 2" in a call), the rest of its message is the same."""
    rows = table.drop_columns(list(drop)).to_pylist()
    for r in rows:
        if r["error"] is not None:
            r["error"] = r["error"].replace("in.parquet row", "prompts row")
    return rows


def test_generate_equals_run_job(setup):
    """A table with the job's columns (its passthrough column too), and a list with prompt_ids
    (no passthrough columns then): the job's rows, bit for bit."""
    _, _, jobs, pool = setup
    want = jobs["base"]
    assert want.num_rows == 18 and want.column("error").null_count == 15  # the empty prompt: 3 error rows
    got = pool.generate(_table(), SEED)
    assert got.schema == want.schema.remove_metadata()
    assert _rows(got) == _rows(want)
    assert "prompts row 2 column 'prompt': prompt is an empty string" in got.column("error").to_pylist()
    assert got.column("level").to_pylist() == [v for v in LEVELS for _ in range(3)]
    assert _rows(pool.generate(PROMPTS, SEED, prompt_ids=IDS)) == _rows(want, drop=["level"])


def test_call_parameters_and_bad_calls(setup):
    """params: a dict of sampling keys over the config's equals the same SamplingParams;
    token-id and chat prompts; a bad key, mixed prompt kinds or duplicate ids fail before any work."""
    from engine import SamplingParams
    from engine.tokenizers.base import Tokenizer
    from jobs.errors import InputError, SpecError

    ck, _, _, pool = setup
    greedy = pool.generate(PROMPTS[:2], {"temperature": 0.0, "num_samples": 1, "stop": None, "seed": 1})
    assert greedy.num_rows == 2 and greedy.column("prompt_id").to_pylist() == ["0", "1"]
    same = pool.generate(PROMPTS[:2], SamplingParams(num_samples=1, max_tokens=8, temperature=0.0, top_k=20, seed=1))
    assert same_rows(same) == same_rows(greedy)
    tokens = pool.generate([[256, 72, 105]], {"num_samples": 2})
    assert tokens.column("prompt_tokens").to_pylist() == [[256, 72, 105]] * 2
    chat = [{"role": "user", "content": "Hi"}]
    rendered = Tokenizer.load(ck["tokenizer"]).render_chat(chat)
    assert pool.generate([chat], {"num_samples": 1}).column("prompt_tokens").to_pylist() == [rendered]
    with pytest.raises(SpecError, match="sampling.temprature"):
        pool.generate(PROMPTS, {"temprature": 0.5})
    with pytest.raises(ValueError, match=r"prompts\[0\] is text, prompts\[1\] is tokens"):
        pool.generate(["a", [1, 2]])
    with pytest.raises(InputError, match="'x' appears twice"):
        pool.generate(["a", "b"], prompt_ids=["x", "x"])


def test_load_weights_in_place_then_equals_a_job_on_the_new_checkpoint(setup):
    ck, _, jobs, pool = setup
    before = {s["worker"]: s for s in pool.engine_states()}
    assert len(before) == 2
    states = pool.load_weights(ck["trained"])
    assert {s["worker"]: (s["pid"], s["kv_cache_ptr"]) for s in states} == \
        {w: (s["pid"], s["kv_cache_ptr"]) for w, s in before.items()}
    assert all(s["weights"]["path"] == str(ck["trained"]) and s["weights"]["step"] == 650 for s in states)
    got = pool.generate(_table(), SEED)
    # weight_version counts the pool's swaps: 1 here, 0 in a job that loaded `trained` at start
    assert _rows(got, SWAPS) == _rows(jobs["trained"], SWAPS)
    assert {v for vs in got.column("weight_version").to_pylist() for v in vs} == {1}
    assert got.column("tokens").to_pylist() != jobs["base"].column("tokens").to_pylist()


def test_mismatched_checkpoints_are_refused_and_the_weights_kept(setup):
    from cluster.weight_sync import WeightsRefused

    ck, _, _, pool = setup
    before = pool.generate(_table(), SEED)
    pids = sorted(s["pid"] for s in pool.engine_states())
    with pytest.raises(WeightsRefused, match=r"window_pattern 'L' \(loaded: 'SSSL'\).*keep the weights"):
        pool.load_weights(ck["other_config"])
    with pytest.raises(WeightsRefused, match=r"n_layer 3 \(loaded: 4\)"):
        pool.load_weights(ck["other_shapes"])
    assert same_rows(pool.generate(_table(), SEED)) == same_rows(before)
    assert sorted(s["pid"] for s in pool.engine_states()) == pids


def test_replacement_workers_load_the_current_weights(setup):
    """Both workers killed after a swap: the call still succeeds, on new processes that
    loaded the swapped weights (not the config's checkpoint)."""
    ck, _, jobs, pool = setup
    pool.load_weights(ck["trained"])
    old = sorted(s["pid"] for s in pool.engine_states())
    for pid in old:
        os.kill(pid, signal.SIGKILL)
    got = pool.generate(_table(), SEED)
    assert _rows(got, SWAPS) == _rows(jobs["trained"], SWAPS)
    states = pool.engine_states()
    assert len(states) == 2 and not set(s["pid"] for s in states) & set(old)
    assert all(s["weights"]["path"] == str(ck["trained"]) for s in states)
