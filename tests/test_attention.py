"""engine.kernels.attention: cascade (shared-prefix) decode attention over the KV arena.

Both implementations (the batch-invariant CPU one and the batched one GPUs use) must equal
plain attention over each row's whole history (prompt + own tokens) computed in float64, for
grouped-query and plain multi-head shapes, with and without a sliding window. The invariant
one must also give every row bit-identical output whatever other rows share the step, in
whatever order: that is what makes the engine's samples batch-invariant. The CPU path has two
implementations (the compiled kernel of engine/kernels/native.py, and torch's kernels where it is
unavailable): every test here runs with each.
"""
import random

import pytest
import torch
import torch.nn.functional as F

import engine.kernels.attention as A
from engine.kernels.attention import decode_grouped, merge_attention, native_kernel
from engine.kernels.batched_attention import decode_batched
from engine.kernels.kv_layout import KVLayout

pytestmark = pytest.mark.invariance  # run again limited to AVX2 by tests/test_isa.py


@pytest.fixture(params=["native", "torch"], autouse=True)
def decode_impl(request, monkeypatch):
    """decode_grouped through the compiled kernel, then through torch's kernels (its fallback)."""
    if request.param == "torch":
        monkeypatch.setattr(A, "native_kernel", lambda dtype, head_dim: None)
    elif native_kernel(torch.float32, 64) is None:
        pytest.skip("the compiled decode kernel is unavailable here")
    return request.param


def _scenario(seed: int, Hkv: int, D: int, sharing: bool):
    """A random arena and rows: 4 prompts; samples in lockstep cohorts at a regular stride
    (as the scheduler allocates them) and late joiners at other positions.

    Returns (kc, vc, rows) with rows as dicts of own_start, own_pos0, prefix_start, position
    and the list of arena positions holding the row's history in order.
    """
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    N = 4000
    kc, vc = torch.randn(N, Hkv, D, generator=g), torch.randn(N, Hkv, D, generator=g)
    rows = []
    top = N
    free = 0
    for _ in range(4):
        P = rng.randint(1, 60)
        top -= P
        prompt = top
        for cohort in range(2):
            n, G, gen = rng.randint(1, 5), 48, rng.randint(0, 30)
            for i in range(n):
                start = free + i * (G + (P if not sharing else 0))
                pos = P + gen
                if sharing:
                    hist = list(range(prompt, prompt + P)) + list(range(start, start + gen + 1))
                    rows.append(dict(own_start=start, own_pos0=P, prefix_start=prompt, position=pos, hist=hist,
                                     prompt_len=P))
                else:
                    kc[start:start + P], vc[start:start + P] = kc[prompt:prompt + P], vc[prompt:prompt + P]
                    hist = list(range(start, start + pos + 1))
                    rows.append(dict(own_start=start, own_pos0=0, prefix_start=-1, position=pos, hist=hist,
                                     prompt_len=P))
            free += n * (G + (P if not sharing else 0))
    return kc, vc, rows


def _layout(rows, split=True):
    return KVLayout.for_decode([r["own_start"] for r in rows], [r["own_pos0"] for r in rows],
                               [r["prefix_start"] for r in rows], [r["position"] for r in rows], "cpu",
                               prompt_len=[r["prompt_len"] if split else r["own_pos0"] for r in rows])


def _reference(kc, vc, q, rows, window):
    out = []
    for i, r in enumerate(rows):
        hist = torch.tensor(r["hist"])
        kpos = torch.arange(len(hist))
        keep = (r["position"] - kpos <= window) if window is not None else torch.ones(len(hist), dtype=torch.bool)
        k = kc[hist[keep]].permute(1, 0, 2)[None].double()
        v = vc[hist[keep]].permute(1, 0, 2)[None].double()
        out.append(F.scaled_dot_product_attention(q[i:i + 1].double(), k, v, enable_gqa=True))
    return torch.cat(out).float()


SHAPES = [(9, 3, 64), (4, 4, 8), (8, 2, 32)]  # (n_head, n_kv_head, head_dim): SmolLM2's, GPT-2-like, toy


@pytest.mark.parametrize("sharing", [True, False], ids=["shared", "own-copy"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_decode_equals_attention_over_the_whole_history(shape, window, sharing):
    Hq, Hkv, D = shape
    kc, vc, rows = _scenario(1, Hkv, D, sharing)
    q = torch.randn(len(rows), Hq, 1, D, generator=torch.Generator().manual_seed(2))
    want = _reference(kc, vc, q, rows, window)
    layout = _layout(rows)
    assert len(layout.generated_groups()) < len(rows)  # cohorts really share calls
    for fn in (decode_grouped, decode_batched):
        for split in (True, False):  # own copies attended in two parts (split) or one
            got = fn(kc, vc, q, layout if split else _layout(rows, split=False), window)
            assert got.shape == q.shape
            assert (got - want).abs().max().item() < 1e-5, fn.__name__


@pytest.mark.parametrize("sharing", [True, False], ids=["shared", "own-copy"])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_invariant_decode_rows_do_not_depend_on_the_step(shape, window, sharing):
    """Each row alone, in random subsets, in reverse order (no stride groups), and next to
    other rows of its prompt or not: always the same bits as in the full step."""
    Hq, Hkv, D = shape
    kc, vc, rows = _scenario(3, Hkv, D, sharing)
    q = torch.randn(len(rows), Hq, 1, D, generator=torch.Generator().manual_seed(4))
    full = decode_grouped(kc, vc, q, _layout(rows), window)
    rng = random.Random(5)
    subsets = [[i] for i in range(len(rows))] + [list(range(len(rows)))[::-1]]
    subsets += [sorted(rng.sample(range(len(rows)), rng.randint(2, len(rows) - 1))) for _ in range(6)]
    for sub in subsets:
        got = decode_grouped(kc, vc, q[sub], _layout([rows[i] for i in sub]), window)
        for j, i in enumerate(sub):
            assert torch.equal(got[j], full[i]), f"row {i} in subset {sub}"


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_decode_stores_this_steps_keys_and_reads_strided_views(shape):
    """With new_kv, decode_grouped stores each row's key and value at its write position
    first (the compiled kernel does it in the same call), reading q, k and v as the strided
    views of one fused (B, 1, Hq + 2 Hkv, D) projection a Llama layer makes: the same arena
    and the same bits as writing them with index_copy_ and attending contiguous copies."""
    Hq, Hkv, D = shape
    kc, vc, rows = _scenario(8, Hkv, D, True)
    qkv = torch.randn(len(rows), 1, Hq + 2 * Hkv, D, generator=torch.Generator().manual_seed(9))
    q, k, v = (t.transpose(1, 2) for t in qkv.split([Hq, Hkv, Hkv], dim=2))  # (B, H, 1, D) views
    assert not q.is_contiguous()
    layout = _layout(rows)
    kc2, vc2 = kc.clone(), vc.clone()
    got = decode_grouped(kc, vc, q, layout, None, new_kv=(k, v))
    idx = layout.write_index()
    kc2.index_copy_(0, idx, k[:, :, 0].contiguous())
    vc2.index_copy_(0, idx, v[:, :, 0].contiguous())
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(got, decode_grouped(kc2, vc2, q.contiguous(), _layout(rows), None))


def test_layout_advance_moves_every_row_one_position():
    """A layout advanced by a step reads one more own key per row, as a fresh layout would."""
    Hq, Hkv, D = 9, 3, 64
    kc, vc, rows = _scenario(6, Hkv, D, True)
    q = torch.randn(len(rows), Hq, 1, D, generator=torch.Generator().manual_seed(7))
    layout = _layout(rows)
    decode_grouped(kc, vc, q, layout, None)
    layout.advance()
    moved = [dict(r, position=r["position"] + 1) for r in rows]
    for fn in (decode_grouped, decode_batched):
        assert torch.equal(fn(kc, vc, q, layout, 7), fn(kc, vc, q, _layout(moved), 7))


def test_merge_is_exact_and_handles_an_empty_part():
    """Merging attention over two halves of the keys equals attention over all of them; an
    empty part (log-sum-exp -inf, output 0) leaves the other unchanged, bit for bit."""
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 3, 4, 16, generator=g), torch.randn(2, 3, 30, 16, generator=g), torch.randn(2, 3, 30, 16, generator=g)
    fa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o1, l1 = fa(q, k[:, :, :11], v[:, :, :11], 0.0, False)
    o2, l2 = fa(q, k[:, :, 11:], v[:, :, 11:], 0.0, False)
    whole = F.scaled_dot_product_attention(q.double(), k.double(), v.double()).float()
    assert (merge_attention(o1, l1, o2, l2) - whole).abs().max() < 1e-6
    empty = merge_attention(o1, l1, torch.zeros_like(o1), torch.full_like(l1, float("-inf")))
    assert torch.equal(empty, o1)


def _intel_avx512() -> bool:
    """An Intel CPU with AVX-512, whose MKL kernels (inside torch's CPU flash kernel, and not
    limited by ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA) moved rows with the call's shape
    on a Sapphire Rapids Xeon (issue #18)."""
    from engine.kernels.build import cpu_flags

    try:
        vendor = next(line for line in open("/proc/cpuinfo") if line.startswith("vendor_id"))
    except (OSError, StopIteration):
        return False
    return "GenuineIntel" in vendor and "avx512f" in cpu_flags()


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_shared_and_copied_prompts_give_identical_bits(shape, window, decode_impl):
    """A row that reads its prompt from the shared run and one that reads its own copy of it
    (prefix_sharing off) get bit-identical invariant attention: both split at the prompt's end.
    Torch's fallback holds this only where its kernels happen to (README, batch invariance):
    not on Intel's AVX-512 CPUs, where the engine uses the compiled kernel."""
    if decode_impl == "torch" and _intel_avx512():
        pytest.skip("torch's fallback attention is not batch-invariant on Intel AVX-512 CPUs (MKL's kernels); "
                    "the compiled kernel is, and is what the engine runs here")
    Hq, Hkv, D = shape
    kc, vc, rows = _scenario(8, Hkv, D, True)
    q = torch.randn(len(rows), Hq, 1, D, generator=torch.Generator().manual_seed(9))
    copies = []
    free = max(r["own_start"] for r in rows) + 200
    for r in rows:  # copy = the prompt followed by the row's generated keys, elsewhere in the arena
        hist = torch.tensor(r["hist"])
        kc[free:free + len(hist)], vc[free:free + len(hist)] = kc[hist], vc[hist]
        copies.append(dict(own_start=free, own_pos0=0, prefix_start=-1, position=r["position"],
                           prompt_len=r["prompt_len"]))
        free += 64 + r["prompt_len"]  # a regular stride within cohorts, as the scheduler gives
    shared = decode_grouped(kc, vc, q, _layout(rows), window)
    copied = decode_grouped(kc, vc, q, _layout(copies), window)
    assert torch.equal(shared, copied)


LENGTHS = list(range(1, 40)) + [63, 64, 65, 66, 127, 128, 129, 130, 510, 511, 512, 513, 514, 515, 700]


@pytest.mark.parametrize("shape", [(12, 12, 64), (9, 3, 64), (8, 4, 32), (6, 3, 80)],
                         ids=lambda s: f"{s[0]}x{s[1]}x{s[2]}")
def test_generated_parts_of_every_length_are_row_invariant(shape):
    """The generated part is read in key chunks (one query head per KV head: torch's kernel
    then takes its fast matrix-vector path) or with query rows padded to keep the kernel's
    per-thread buffers aligned (grouped-query heads), both chosen from the row's own length
    only. Over lengths 1..700 (around the kernel's 512-key block and the alignment residues),
    a row gives the same bits alone, beside its cohort, with holes in the cohort (finished
    samples), and on one thread or two; and it equals float64 attention."""
    Hq, Hkv, D = shape
    n, stride = 6, 720
    gen = torch.Generator().manual_seed(11)
    kc = torch.randn(n * stride, Hkv, D, generator=gen)
    vc = torch.randn(n * stride, Hkv, D, generator=gen)
    q = torch.randn(n, Hq, 1, D, generator=gen)
    threads = torch.get_num_threads()

    def run(rows, pos):
        layout = KVLayout.for_decode([r * stride for r in rows], [0] * len(rows), [-1] * len(rows),
                                     [pos] * len(rows), "cpu", prompt_len=[0] * len(rows))
        return decode_grouped(kc, vc, q[rows], layout, None)

    try:
        for L in LENGTHS:
            full = run(list(range(n)), L - 1)
            k = kc.view(n, stride, Hkv, D)[:, :L].permute(0, 2, 1, 3).double()
            v = vc.view(n, stride, Hkv, D)[:, :L].permute(0, 2, 1, 3).double()
            want = F.scaled_dot_product_attention(q.double(), k, v, enable_gqa=True)
            assert (full.double() - want).abs().max() < 1e-5, L
            for rows in ([0], [3], [5], [0, 2, 5], [1, 4]):
                got = run(rows, L - 1)
                for j, r in enumerate(rows):
                    assert torch.equal(got[j], full[r]), f"length {L}, row {r} among {rows}"
            torch.set_num_threads(1)
            assert torch.equal(run(list(range(n)), L - 1), full), f"length {L}, one thread"
            torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


def test_key_chunks_and_query_rows_follow_the_alignment_rule():
    """Every chunk (or padded call) keeps q * (keys + 2 + head_dim) a multiple of 4 within one
    512-key block, or is at most 3 keys; chunks cover the length exactly."""
    from engine.kernels.attention import aligned_query_rows, key_chunks
    for D in (64, 80, 128):
        for L in range(1, 1200):
            chunks = key_chunks(L, 1, D)
            assert sum(chunks) == L and len(chunks) <= 2 + L // 512
            assert all(c <= 3 or (c <= 512 and (c + 2 + D) % 4 == 0) for c in chunks)
            for g in (2, 3, 4, 5, 7):
                rows = aligned_query_rows(g, L, D)
                assert g <= rows <= g + 3
                assert L <= 3 or rows * (min(L, 512) + 2 + D) % 4 == 0


def test_where_the_alignment_rule_fails_its_probe_decode_pads_to_16_rows(monkeypatch):
    """The rule is probed on this machine (it holds here); on a CPU where it would not, every
    item is padded to 16 query rows: still exact, still row-invariant."""
    monkeypatch.setattr(A, "native_kernel", lambda dtype, head_dim: None)
    assert A.alignment_rule_holds(64, torch.float32)
    Hq, Hkv, D = 9, 3, 64
    kc, vc, rows = _scenario(3, Hkv, D, True)
    q = torch.randn(len(rows), Hq, 1, D, generator=torch.Generator().manual_seed(4))
    want = _reference(kc, vc, q, rows, None)
    monkeypatch.setattr(A, "alignment_rule_holds", lambda head_dim, dtype: False)
    full = decode_grouped(kc, vc, q, _layout(rows), None)
    assert (full - want).abs().max().item() < 1e-5
    for i in range(len(rows)):
        assert torch.equal(decode_grouped(kc, vc, q[[i]], _layout([rows[i]]), None)[0], full[i])


def test_the_compiled_kernel_is_built_where_it_can_be(decode_impl):
    """On x86-64 with AVX2 and a C++ compiler (this machine, CI) the kernel is built and used,
    so the tests above exercise it rather than silently falling back; head sizes it does not
    handle, and bfloat16, go to torch's kernels."""
    import platform
    import shutil
    if platform.machine() != "x86_64" or torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") \
            or shutil.which("c++") is None:
        pytest.skip("not a machine the kernel is built for")
    kernel = native_kernel(torch.float32, 64) if decode_impl == "native" else A.native_kernels()
    assert kernel is not None
    assert all(kernel.supports(d) for d in (8, 24, 32, 48, 64, 80, 96, 120, 128, 256)) and not kernel.supports(12)
    assert not kernel.supports(136) and A.native_kernel(torch.float32, 12) is None
    assert A.native_kernel(torch.bfloat16, 64) is None  # the queries must be float32 (over either cache)


def test_the_kernel_falls_back_when_it_cannot_be_built(monkeypatch, tmp_path):
    """BATCHGEN_NATIVE=0, or a compiler that fails, makes the build raise (and
    native_kernels return None): attention then runs on torch's kernels."""
    import engine.kernels.build as B
    import engine.kernels.native as N
    monkeypatch.setenv("BATCHGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("BATCHGEN_NATIVE", "0")
    with pytest.raises(B.Unavailable, match="BATCHGEN_NATIVE=0"):
        B.build_library("avx2")
    monkeypatch.setattr(N, "_isa_choice", False)  # not decided yet in this process
    assert N.native_isa() is None and N.native_kernels() is None
    monkeypatch.setenv("BATCHGEN_NATIVE", "1")
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setattr(N, "_isa_choice", False)
    monkeypatch.setattr(N, "_libraries", {})  # not tried yet in this process
    if N.supported_isas():
        with pytest.raises(B.Unavailable, match="failed"):
            B.build_library(N.supported_isas()[0])
    assert N.native_kernels() is None
    assert list(tmp_path.iterdir()) == []  # no half-built library left behind


def test_runs_outside_the_arena_are_refused():
    """The kernel reads what it is told: the layout checks every run against the arena first."""
    layout = KVLayout.for_decode([90], [0], [-1], [20], "cpu", prompt_len=[0])
    assert layout.native_segments(None, 200)[0].tolist() == [[0, 0, 90, 21]]
    with pytest.raises(ValueError, match="outside the arena"):
        layout.native_segments(None, 100)
