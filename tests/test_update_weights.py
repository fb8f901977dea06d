"""Weights from memory: a trainer's tensors swapped into a loaded model in place.

Engine level (no Ray), per family, with checkpoints written by transformers (Llama with
biases and an untied head, Qwen3 with q/k norms and a tied head, GPT-2 with its Conv1D
layouts) and nanochat's own layout: `Engine.update_weights(state dict of checkpoint 2)` on an
engine loaded from checkpoint 1 leaves exactly (bit for bit, every tensor) the model that
loading checkpoint 2 builds, in float32 and in bfloat16 (float32 tensors cast by the swap),
in the same parameter storage; a state dict that does not fit is refused naming every
difference, and nothing changes; nor does a value without data (a numpy array, a meta tensor).

Pool level (a real Ray head, 2 workers, a tiny Llama written by transformers):
`GenerationPool.update_weights` in buckets smaller than one tensor and larger than several
gives rows equal to a fresh engine on checkpoint 2, in the same worker processes and KV
cache, with weight_version counted; a mismatch is refused naming the worker and each
difference and the rows stay; a worker killed after the update is replaced by one that
copies the weights from a live worker; with every worker killed, the update is reported
lost rather than silently replaced by the checkpoint (a refused swap does not clear that); a
meta tensor, or a driver failing before its first bucket, replaces no worker.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

transformers = pytest.importorskip("transformers")

import weights_cases  # noqa: E402
from engine import SamplingParams, load_engine  # noqa: E402
from engine.loading.checkpoint import load_model  # noqa: E402
from engine.loading.weight_swap import WeightsMismatch  # noqa: E402

SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
PROMPTS = [[256, 5, 6, 7, 8, 9], [256] + [3] * 20, [256, 100, 101]]
IDS = ["a", "b", "c"]
PARAMS = SamplingParams(num_samples=2, max_tokens=8, top_k=20, seed=3, stop_token_ids=[])


def _hf(family: str, seed: int) -> torch.nn.Module:
    if family == "llama":
        cfg = transformers.LlamaConfig(**SHAPE, tie_word_embeddings=False, attention_bias=True, mlp_bias=True)
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=16, tie_word_embeddings=True))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=128,
                                                                     vocab_size=300))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1 + 0.3 * noise if "norm" in n or "ln_" in n else 0.15 * noise)
    return model.eval()


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """family -> (checkpoint 1, checkpoint 2, checkpoint 2's state dict in the trainer's names)."""
    root = tmp_path_factory.mktemp("update")
    out = {}
    for family in ("llama", "qwen3", "gpt2"):
        one, two = _hf(family, 1), _hf(family, 2)
        one.save_pretrained(root / f"{family}-1")
        two.save_pretrained(root / f"{family}-2")
        out[family] = (root / f"{family}-1", root / f"{family}-2", two.state_dict())
    ck = weights_cases.build(root / "nanochat")
    trained = torch.load(ck["trained"] / f"model_{weights_cases.STEP:06d}.pt", weights_only=True)
    assert all(k.startswith("_orig_mod.") for k in trained)  # as torch.compile'd nanochat saves them
    out["nanochat"] = (ck["base"], ck["trained"], trained)
    out["tokenizer"] = ck["tokenizer"]
    return out


@pytest.mark.parametrize("family,dtype", [("llama", "float32"), ("qwen3", "float32"), ("gpt2", "float32"),
                                          ("nanochat", "float32"), ("llama", "bfloat16"), ("gpt2", "bfloat16")])
def test_update_equals_loading_the_checkpoint(cases, family, dtype):
    """Every tensor of the updated model equals the freshly loaded one exactly; parameters keep
    their storage; the engine then generates what a fresh engine does; weight_version counts."""
    one, two, sd = cases[family]
    eng = load_engine(one, device="cpu", dtype=dtype, tokenizer=cases["tokenizer"], max_seq_len=64, num_threads=1)
    eng.generate(PROMPTS, PARAMS, prompt_ids=IDS)  # packed copies of the old weights exist now
    pointers = [p.data_ptr() for p in eng.model.parameters()]
    info = eng.update_weights(sd)
    assert info["path"] == "<memory>" and info["weight_version"] == eng.weight_version == 1
    assert [p.data_ptr() for p in eng.model.parameters()] == pointers
    want = load_model(two, device="cpu", dtype=dtype, step=None).state_dict()
    got = eng.model.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    fresh = load_engine(two, device="cpu", dtype=dtype, tokenizer=cases["tokenizer"], max_seq_len=64, num_threads=1)
    run = lambda e: [[(s.tokens, s.logprobs) for s in r] for r in e.generate(PROMPTS, PARAMS, prompt_ids=IDS)]  # noqa: E731
    assert run(eng) == run(fresh)


def test_bfloat16_trainer_tensors_and_pairs(cases):
    """A bfloat16 trainer's tensors, given as a list of pairs, equal loading them from a file."""
    one, _, sd = cases["llama"]
    half = [(k, v.to(torch.bfloat16)) for k, v in sd.items()]
    eng = load_engine(one, device="cpu", dtype="float32", tokenizer=cases["tokenizer"], max_seq_len=64, num_threads=1)
    eng.update_weights(iter(half))
    for k, t in eng.model.state_dict().items():
        assert t.dtype == torch.float32, k
    embed = eng.model.state_dict()["embed"]
    assert torch.equal(embed, sd["model.embed_tokens.weight"].to(torch.bfloat16).float())


def test_a_state_dict_that_does_not_fit_is_refused_naming_each_difference(cases):
    one, _, sd = cases["llama"]
    eng = load_engine(one, device="cpu", dtype="float32", tokenizer=cases["tokenizer"], max_seq_len=64, num_threads=1)
    before = {k: t.clone() for k, t in eng.model.state_dict().items()}
    bad = dict(sd)
    del bad["model.layers.1.mlp.up_proj.weight"]
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)
    bad["model.extra.weight"] = torch.zeros(3)
    bad["model.norm.weight"] = torch.zeros(32, dtype=torch.int64)
    with pytest.raises(WeightsMismatch) as e:
        eng.update_weights(bad)
    msg = str(e.value)
    assert "tensors missing: model.layers.1.mlp.up_proj.weight" in msg
    assert "tensors the loaded model does not have: model.extra.weight" in msg
    assert "model.layers.0.self_attn.k_proj.weight (8, 32) (expected (16, 32))" in msg
    assert "not floating point: model.norm.weight int64" in msg
    assert all(torch.equal(t, before[k]) for k, t in eng.model.state_dict().items())
    assert eng.weight_version == 0


def test_tensors_without_data_are_refused_before_any_copy(cases):
    """A value that is not a tensor (a numpy array: its dtype and shape pass the check) or a
    tensor without data (the meta device) is refused naming it before anything is copied.
    It used to fail in the middle of the copy: every tensor before it swapped in, the
    weight_version counted, and the packed copies of the old matrices still in use."""
    one, _, sd = cases["llama"]
    eng = load_engine(one, device="cpu", dtype="float32", tokenizer=cases["tokenizer"], max_seq_len=64, num_threads=1)
    before = {k: t.clone() for k, t in eng.model.state_dict().items()}
    last = list(sd)[-1]
    for value, why in ((sd[last].numpy(), "is a ndarray"), (torch.empty(sd[last].shape, device="meta"), "meta device")):
        with pytest.raises(TypeError, match=rf"{last}.*{why}"):
            eng.update_weights({**sd, last: value})
    assert all(torch.equal(t, before[k]) for k, t in eng.model.state_dict().items())
    assert eng.weight_version == 0


def test_a_tied_models_lm_head_is_the_embedding_sent(cases):
    """A tied model (Qwen3 here) takes its head from model.embed_tokens.weight and skips an
    lm_head.weight, as vLLM's load_weights (skip_prefixes=["lm_head."] when
    tie_word_embeddings) and transformers' tie_weights do (docs/rl.md): the state dict of a
    tied model (transformers', FSDP's), which names one tensor twice, swaps in; one whose
    lm_head.weight differs gives the model of its embedding, and leaving it out is fine too."""
    one, two, sd = cases["qwen3"]
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()  # one tensor, twice
    want = load_model(two, device="cpu", dtype="float32", step=None).state_dict()
    eng = load_engine(one, device="cpu", dtype="float32", tokenizer=cases["tokenizer"], max_seq_len=64, num_threads=1)
    for variant in ({k: v.clone() for k, v in sd.items()},  # equal values, separate tensors
                    {**sd, "lm_head.weight": torch.randn(sd["lm_head.weight"].shape)},
                    {k: v for k, v in sd.items() if k != "lm_head.weight"}):
        eng.update_weights(variant)
        got = eng.model.state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    assert eng.weight_version == 3


# ------------------------------------------------------------------ a pool
@pytest.fixture(scope="module")
def pool(cases, ray_local):
    from jobs import GenerationPool

    one, _, _ = cases["llama"]
    config = {"model": {"path": str(one), "tokenizer": str(cases["tokenizer"]), "max_num_seqs": 16,
                        "max_seq_len": 64, "dtype": "float32"},
              "sampling": {"num_samples": 2, "max_tokens": 8, "top_k": 20, "seed": 3, "stop_token_ids": []}}
    with GenerationPool(config, {"cluster.num_workers": 2, "cluster.unit_rows": 1}) as p:
        yield p


def _pool_rows(pool):
    t = pool.generate(PROMPTS, {"seed": 3}, prompt_ids=IDS)
    return [(r["tokens"], r["logprobs"]) for r in t.to_pylist()]


def _engine_rows(path, tok):
    eng = load_engine(path, device="cpu", dtype="float32", tokenizer=tok, max_seq_len=64, num_threads=1)
    return [(s.tokens, s.logprobs) for r in eng.generate(PROMPTS, PARAMS, prompt_ids=IDS) for s in r]


def test_pool_update_in_buckets_equals_a_fresh_engine(pool, cases):
    """Buckets of 4 KiB (most tensors alone, some larger than a bucket) and of 1 MiB (all
    in one): the rows equal a fresh engine on checkpoint 2, in the same processes and KV
    cache; each swap counts one weight_version."""
    one, two, sd = cases["llama"]
    assert _pool_rows(pool) == _engine_rows(one, cases["tokenizer"])
    before = {s["worker"]: s for s in pool.engine_states()}
    states = pool.update_weights(sd, bucket_bytes=4096)
    assert {s["worker"]: (s["pid"], s["kv_cache_ptr"]) for s in states} == \
        {w: (s["pid"], s["kv_cache_ptr"]) for w, s in before.items()}
    assert [s["weight_version"] for s in states] == [1, 1] and states[0]["weights"]["path"] == "<memory>"
    assert _pool_rows(pool) == _engine_rows(two, cases["tokenizer"])
    pool.load_weights(one)
    assert _pool_rows(pool) == _engine_rows(one, cases["tokenizer"])
    states = pool.update_weights(list(sd.items()), bucket_bytes=1 << 20)
    assert [s["weight_version"] for s in states] == [3, 3]
    assert _pool_rows(pool) == _engine_rows(two, cases["tokenizer"])


def test_pool_refuses_a_mismatch_and_replacements_copy_the_update(pool, cases):
    """A state dict with a tensor missing and one misshapen: WeightsRefused names a worker and
    both, and the rows do not change. After an update, one worker killed: its replacement
    copies the weights from the live one (rows equal checkpoint 2's). Both killed: the
    update's weights are lost, and the next call fails naming it instead of running on the
    checkpoint, a refused update_weights changing nothing of that; a new update_weights
    makes the pool whole again."""
    from cluster.unit import UnitFailed
    from cluster.weight_sync import WeightsRefused

    one, two, sd = cases["llama"]
    pool.load_weights(one)
    before = _pool_rows(pool)
    bad = {k: v for k, v in sd.items() if k != "model.norm.weight"}
    bad["lm_head.weight"] = torch.zeros(10, 32)
    with pytest.raises(WeightsRefused, match=r"worker-\d+: WeightsMismatch: .*tensors missing: model.norm.weight.*"
                                             r"lm_head.weight \(10, 32\) \(expected \(300, 32\)\).*keep the weights"):
        pool.update_weights(bad)
    assert _pool_rows(pool) == before
    version = pool.update_weights(sd, bucket_bytes=64 << 10)[0]["weight_version"]
    want = _engine_rows(two, cases["tokenizer"])
    killed = pool.engine_states()[0]["pid"]
    os.kill(killed, signal.SIGKILL)
    assert _pool_rows(pool) == want
    states = pool.engine_states()
    assert len(states) == 2 and killed not in {s["pid"] for s in states}
    assert {s["weight_version"] for s in states} == {version} and {s["weights"]["path"] for s in states} == {"<memory>"}
    for s in states:
        os.kill(s["pid"], signal.SIGKILL)
    with pytest.raises(UnitFailed, match=r"weights of update_weights \(weight version \d+\) were lost"):
        pool.generate(PROMPTS, {"seed": 3}, prompt_ids=IDS)
    # a refused swap swaps nothing: the loss still stands (it used to be forgotten, and the
    # next call ran on the checkpoint under the lost update's weight_version)
    with pytest.raises(WeightsRefused):
        pool.update_weights(bad)
    with pytest.raises(UnitFailed, match=r"weights of update_weights \(weight version \d+\) were lost"):
        pool.generate(PROMPTS, {"seed": 3}, prompt_ids=IDS)
    pool.update_weights(sd)
    assert _pool_rows(pool) == want


def test_pool_refuses_tensors_without_data_and_keeps_its_workers(pool, cases, monkeypatch):
    """A tensor on the meta device is refused naming it before any worker is asked; and a
    driver failing before it sent any bucket replaces no worker (none holds part of the
    update). Both used to replace every worker: the meta tensor failed the driver while
    packing its bucket, and any such failure replaced every checked worker."""
    import cluster.weight_sync as weight_sync

    one, _, sd = cases["llama"]
    pool.load_weights(one)
    before = _pool_rows(pool)
    pids = sorted(s["pid"] for s in pool.engine_states())
    last = list(sd)[-1]
    with pytest.raises(TypeError, match=rf"{last} is on the meta device"):
        pool.update_weights({**sd, last: torch.empty(sd[last].shape, device="meta")}, bucket_bytes=4096)

    def failing(pairs, bucket_bytes):
        raise MemoryError("the driver ran out of memory packing the first bucket")
        yield  # a generator, as pack_buckets

    monkeypatch.setattr(weight_sync, "pack_buckets", failing)
    with pytest.raises(MemoryError):
        pool.update_weights(sd)
    monkeypatch.undo()
    assert sorted(s["pid"] for s in pool.engine_states()) == pids
    assert _pool_rows(pool) == before


def test_worker_holds_new_prompts_during_a_swap_from_memory():
    """A GenerationWorker without Ray: from its first bucket until finish_update, a unit's
    prompts wait in its inbox (the engine never steps on half-swapped weights); then they
    run, on the new weights, as a fresh engine given the same tensors generates them."""
    import threading

    from cluster.weight_buckets import pack_buckets
    from cluster.worker import GenerationWorker
    from engine.loading.weight_swap import weight_map
    from jobs.config import load_job_spec
    from jobs.pool_task import PoolTask

    task = PoolTask(load_job_spec({"model": {"path": "tiny-random", "max_num_seqs": 8, "max_seq_len": 64},
                                   "sampling": {"num_samples": 2, "max_tokens": 4, "seed": 1}}))
    w = GenerationWorker(task, "w0", num_threads=1)
    try:
        params = w.engine.model.state_dict()
        pairs = [(name, params[t.param] * 0.5) for name, t in weight_map(w.engine.model).targets.items() if t]
        bucket = next(pack_buckets(pairs, 1 << 30))
        w.check_update(bucket[0])
        assert w.apply_bucket(bucket) == len(pairs)
        units, call = task.make_units(PROMPTS, {"seed": 1}, IDS, 0, 8)
        results = []
        t = threading.Thread(target=lambda: results.append(w.run_unit(units[0])))
        t.start()
        with w._cv:
            assert w._cv.wait_for(lambda: w._inbox, timeout=60)
        assert not w.engine.has_unfinished_requests() and not results
        assert w.finish_update(7)["weight_version"] == 7
        t.join(60)
        got = task.collect(call, results)
    finally:
        w.shutdown()
    fresh = load_engine("tiny-random", device="cpu", dtype=str(w.engine.dtype).replace("torch.", ""), max_seq_len=64,
                        num_threads=1)
    fresh.update_weights(pairs)
    want = fresh.generate(PROMPTS, task.call_params({"seed": 1}), prompt_ids=IDS)
    assert got.column("tokens").to_pylist() == [s.tokens for r in want for s in r]
    assert got.column("logprobs").to_pylist() == [s.logprobs for r in want for s in r]


def test_a_worker_that_hangs_during_a_swap_is_replaced(pool, cases):
    """A worker stopped (SIGSTOP) before a swap never answers, not even progress():
    `update_weights` gives up on it after start_timeout_s (the time a start may take to load
    the same weights; 5 s here, during the call only, so that the replacement's start has
    the usual time), replaces it uncharged and swaps the others; its replacement starts with
    the new weights, so the rows equal the new checkpoint's. The call used to wait for ever,
    holding the trainer's loop (and `load_weights` likewise: its check is the same
    `_everyone_agrees`, its commit is tested below)."""
    one, two, sd = cases["llama"]
    slots = pool.dispatcher.slots
    timeout = slots.start_timeout_s
    stopped = []
    try:
        pool.load_weights(one)
        pids = [s["pid"] for s in pool.engine_states()]
        for call, want_path in ((lambda: pool.update_weights(sd), "<memory>"),):
            stopped.append(pids[0])
            os.kill(pids[0], signal.SIGSTOP)
            t0 = time.monotonic()
            slots.start_timeout_s = 5.0
            try:
                states = call()
            finally:
                slots.start_timeout_s = timeout
            assert time.monotonic() - t0 < 60
            assert [s["pid"] for s in states] == pids[1:]
            assert _pool_rows(pool) == _engine_rows(two, cases["tokenizer"])
            after = pool.engine_states()
            assert len(after) == 2 and stopped[-1] not in {s["pid"] for s in after}
            assert {s["weights"]["path"] for s in after} == {want_path}
            assert len({s["weight_version"] for s in after}) == 1
            pool.load_weights(one)
            pids = [s["pid"] for s in pool.engine_states()]
    finally:
        for pid in stopped:  # replaced workers are killed; a stopped one left over must not linger
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def test_engine_states_replaces_a_stopped_worker(pool):
    """engine_states() with a worker stopped (SIGSTOP) judges it as a swap does: no answer
    within start_timeout_s (5 s here) nor to progress(), so it is replaced, uncharged, and
    left out; the others' states come back, and the pool serves the next call. It used to
    wait for ever, holding the pool's thread (every call and close() with it)."""
    import threading

    slots = pool.dispatcher.slots
    timeout = slots.start_timeout_s
    pids = sorted(s["pid"] for s in pool.engine_states())
    got: list = []
    os.kill(pids[0], signal.SIGSTOP)
    try:
        slots.start_timeout_s = 5.0
        t = threading.Thread(target=lambda: got.append(pool.engine_states()), daemon=True)
        t.start()
        t.join(90)  # a bound for the old code, which never returned: the fix takes about 10 s
        assert not t.is_alive(), "engine_states() still waits on the stopped worker"
    finally:
        slots.start_timeout_s = timeout
        os.kill(pids[0], signal.SIGCONT)  # killed when replaced; the old code's call returns now
    assert [s["pid"] for s in got[0]] == pids[1:]
    assert pool.generate(PROMPTS, {"seed": 3}, prompt_ids=IDS).num_rows == 2 * len(PROMPTS)
    after = pool.engine_states()
    assert len(after) == 2 and pids[0] not in {s["pid"] for s in after}


def test_a_swap_waits_for_a_worker_finishing_samples_and_replaces_a_still_one(ray_local):
    """A worker's swap first waits for its engine to finish the samples it holds, which may
    take longer than the timeout. commit_everywhere with a 1 s timeout, two Ray actors: the
    one whose commit takes 3 s while its engine generates (its progress() counters grow) is
    waited for and swaps; the one whose commit takes 30 s with its engine standing still is
    replaced as hung once a period passed with nothing moving. (A first version of the timeout replaced any
    worker still busy finishing a call's samples after start_timeout_s.)"""
    import ray

    from cluster.health import WorkerRecord
    from cluster.weight_sync import commit_everywhere

    @ray.remote(max_concurrency=4)
    class Swapper:
        def __init__(self, moving: bool) -> None:
            self.moving, self.tokens = moving, 0

        def commit_weights(self, version: int) -> dict:
            end = time.monotonic() + (3.0 if self.moving else 30.0)
            while time.monotonic() < end:  # the engine finishing samples (or standing still)
                self.tokens += self.moving
                time.sleep(0.05)
            return {"weight_version": version}

        def progress(self) -> dict:
            return {"generated_tokens": self.tokens, "finished_requests": 0, "finished_units": 0}

    moving = WorkerRecord("moving", 0, Swapper.remote(True), None, 0.0)
    still = WorkerRecord("still", 1, Swapper.remote(False), None, 0.0)
    replaced = []
    try:
        ray.get([moving.handle.progress.remote(), still.handle.progress.remote()])  # both started
        states = commit_everywhere({moving: None, still: None}, lambda w, why: replaced.append((w.name, why)), 7,
                                   timeout_s=1.0)
    finally:
        ray.kill(moving.handle)
        ray.kill(still.handle)
    assert states == [{"weight_version": 7}]
    assert [name for name, _ in replaced] == ["still"], replaced
    assert "did not answer its weights swap within 1 s" in replaced[0][1] and "hung" in replaced[0][1]


def test_worker_buckets_of_one_update_share_its_weight_map(cases):
    """A pool worker copies an update bucket by bucket (GenerationWorker.apply_bucket): a
    nanochat state dict whose resid_lambdas and x0_lambdas fall in different buckets (here
    sorted by name, as a trainer may send them) leaves every tensor as loading the checkpoint
    does, as Engine.update_weights in one call does. (Each bucket made its own weight map,
    so the bucket holding x0_lambdas wrote the lambdas' defaults again: resid_lambdas, copied
    by an earlier bucket, became ones.) The next update starts a map of its own: one without
    x0_lambdas patches it to zeros (a map kept from the last update would leave it)."""
    from cluster.weight_buckets import pack_buckets, tensor_index
    from cluster.worker import GenerationWorker
    from jobs.config import load_job_spec
    from jobs.pool_task import PoolTask

    one, two, sd = cases["nanochat"]
    R, X = "_orig_mod.resid_lambdas", "_orig_mod.x0_lambdas"
    task = PoolTask(load_job_spec({"model": {"path": str(one), "tokenizer": str(cases["tokenizer"]), "dtype": "float32",
                                             "max_num_seqs": 8, "max_seq_len": 64}}))
    w = GenerationWorker(task, "w0", num_threads=1)
    try:
        pairs = sorted(sd.items())
        buckets = list(pack_buckets(pairs, 4096))
        where = {name: i for i, (index, _) in enumerate(buckets) for name, _, _ in index}
        assert where[R] != where[X]
        w.check_update(tensor_index(pairs))
        for b in buckets:
            w.apply_bucket(b)
        w.finish_update(1)
        want = load_model(two, device="cpu", dtype="float32", step=None).state_dict()
        got = w.engine.model.state_dict()
        assert sorted(got) == sorted(want)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        assert not torch.equal(got["resid_lambdas"], torch.ones_like(got["resid_lambdas"]))

        without_x0 = [(k, v) for k, v in pairs if k != X]
        w.check_update(tensor_index(without_x0))
        for b in pack_buckets(without_x0, 4096):
            w.apply_bucket(b)
        w.finish_update(2)
        m = w.engine.model
        assert torch.equal(m.x0_lambdas, torch.zeros_like(m.x0_lambdas))
        assert torch.equal(m.resid_lambdas, want["resid_lambdas"])
    finally:
        w.shutdown()
