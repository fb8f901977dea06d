"""jobs.spec: YAML loading, defaults, --set overrides, validation messages, engine arguments."""
from __future__ import annotations

import pytest

from jobs.config import apply_override, load_spec
from jobs.errors import SpecError
from jobs.spec import JobSpec


def write(tmp_path, text: str, name: str = "job.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_from_empty_file(tmp_path):
    spec = load_spec(write(tmp_path, ""))
    d = spec.to_dict()
    assert d["model"] == {"path": "smollm2", "dtype": "auto", "device": "auto", "tokenizer": None, "max_num_seqs": 256,
                          "kv_cache_gb": None, "max_seq_len": None, "batch_invariant": True,
                          "prefix_sharing": True, "prefix_caching": True, "chat_template_date": None}
    assert d["input"] == {"path": "prompts.parquet", "format": "text", "column": "prompt", "id_column": None,
                          "passthrough": [], "sampling_column": None}
    assert d["output"] == {"path": "out/demo", "lease_timeout_s": 120}
    assert d["sampling"] == {"num_samples": 4, "max_tokens": 256, "temperature": 1.0, "top_k": 50, "top_p": 1.0,
                             "min_p": 0.0, "seed": 0, "stop_token_ids": None, "stop": None, "logprobs_mode": "raw",
                             "top_logprobs": 0}
    assert d["tools"] == {"calculator": True, "max_turns": 8, "max_response_chars": None, "parallel_calls": False,
                          "functions": []}
    assert d["cluster"] == {"address": None, "num_workers": 1, "gpus_per_worker": 0, "cpus_per_worker": 1,
                            "unit_rows": 256, "max_unit_attempts": 3, "unit_timeout_s": None}


def test_chat_default_column(tmp_path):
    spec = load_spec(write(tmp_path, "input: {format: chat}\n"))
    assert spec.input.column == "messages"
    spec = load_spec(write(tmp_path, "input: {format: chat, column: conv}\n"))
    assert spec.input.column == "conv"


def test_overrides_parse_yaml_values(tmp_path):
    p = write(tmp_path, "sampling: {temperature: 1.0}\n")
    spec = load_spec(p, ["sampling.temperature=0.7", "cluster.address=auto", "sampling.stop_token_ids=[1,2]",
                         "model.kv_cache_gb=1.5", "output.path=2024", "model.max_seq_len=null"])
    assert spec.sampling.temperature == 0.7
    assert spec.cluster.address == "auto"
    assert spec.sampling.stop_token_ids == [1, 2]
    assert spec.output.path == "2024"
    assert spec.engine_kwargs()["kv_cache_bytes"] == int(1.5 * 2**30)
    assert spec.model.max_seq_len is None


def test_overrides_apply_in_order_and_create_sections():
    d: dict = {}
    apply_override(d, "sampling.seed=1")
    apply_override(d, "sampling.seed=2")
    assert JobSpec.from_dict(d).sampling.seed == 2


@pytest.mark.parametrize("override, fragment", [
    ("sampling.temprature=1", "unknown key sampling.temprature"),
    ("samplin.temperature=1", "unknown key samplin.temperature"),
    ("temperature=1", "expected SECTION.KEY=VALUE"),
    ("sampling.temperature", "expected KEY=VALUE"),
    ("sampling.top_p=1.5", "sampling.top_p: must be in (0, 1], got 1.5"),
    ("sampling.stop_token_ids=[1, -2]", "sampling.stop_token_ids: must be a list of non-negative token ids"),
    ("sampling.temperature=[unclosed", "sampling.temperature: value is not valid YAML"),
])
def test_bad_overrides(tmp_path, override, fragment):
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, ""), [override])
    assert fragment in str(e.value)
    assert e.value.exit_code == 2


@pytest.mark.parametrize("yaml_text, fragment", [
    ("sampling: {top_p: 1.5}", "sampling.top_p: must be in (0, 1], got 1.5"),
    ("sampling: {top_p: 0}", "sampling.top_p: must be in (0, 1], got 0"),
    ("sampling: {temperature: -1}", "sampling.temperature: must be a finite number >= 0"),
    ("sampling: {temperature: .nan}", "sampling.temperature: must be a finite number >= 0"),
    ("sampling: {temperature: .inf}", "sampling.temperature: must be a finite number >= 0"),
    ("sampling: {top_k: -1}", "sampling.top_k: must be an integer >= 0"),
    ("sampling: {min_p: 1.0}", "sampling.min_p: must be in [0, 1), got 1.0"),
    ("sampling: {max_tokens: 0}", "sampling.max_tokens: must be an integer >= 1, got 0"),
    ("sampling: {num_samples: 0}", "sampling.num_samples: must be an integer from 1 to 1,000,000, got 0"),
    ("sampling: {num_samples: 2.5}", "sampling.num_samples: must be an integer from 1 to 1,000,000, got 2.5"),
    ("sampling: {num_samples: true}", "sampling.num_samples: must be an integer from 1 to 1,000,000, got True"),
    ("sampling: {seed: 99999999999999999999}", "sampling.seed: must be a 64-bit integer"),
    ("sampling: {temprature: 1}", "unknown key sampling.temprature"),
    ("cluster: {num_workers: 0}", "cluster.num_workers: must be an integer >= 1, got 0"),
    ("cluster: {unit_rows: 0}", "cluster.unit_rows: must be an integer >= 1, got 0"),
    ("cluster: {max_unit_attempts: 0}", "cluster.max_unit_attempts: must be an integer >= 1"),
    ("cluster: {gpus_per_worker: -1}", "cluster.gpus_per_worker: must be a number >= 0"),
    ("cluster: {cpus_per_worker: 0}", "cluster.cpus_per_worker: must be a number > 0"),
    ("model: {max_num_seqs: 0}", "model.max_num_seqs: must be an integer >= 1"),
    ("model: {kv_cache_gb: 0}", "model.kv_cache_gb: must be a number of GiB > 0"),
    ("model: {dtype: int8}", "model.dtype: Input should be"),
    ("model: {path: ''}", "model.path: must not be empty"),
    ("model: {path: 's3://b/ckpt'}", "model.path: 's3://b/ckpt': object store URIs are not supported"),
    ("model: {tokenizer: 'gs://b/tok'}", "model.tokenizer: 'gs://b/tok': object store URIs are not supported"),
    ("cluster: {unit_timeout_s: 0}", "cluster.unit_timeout_s: must be a number of seconds > 0"),
    ("cluster: {unit_timeout_s: soon}", "cluster.unit_timeout_s: must be a number, got 'soon'"),
    ("output: {lease_timeout_s: 1}", "output.lease_timeout_s: must be a number of seconds >= 5"),
    ("input: {format: xml}", "input.format: Input should be 'text', 'chat', 'tokens' or 'openai_batch'"),
    ("input: {passthrough: [a, a]}", "input.passthrough: column 'a' is listed twice"),
    ("input: {passthrough: [text]}", "input.passthrough: column 'text' would overwrite the output column"),
    ("tools: {calculator: maybe}", "tools.calculator: Input should be a valid boolean"),
    ("tool: {calculator: true}", "unknown key tool"),
    ("sampling: 3", "sampling: must be a mapping, got 3"),
    ("model: {device: gpu}", "model.device: must be auto, cpu, cuda or cuda:N (N: a GPU index), got 'gpu'"),
    ("model: {device: banana}", "model.device: must be auto, cpu, cuda or cuda:N"),
    ("model: {device: 'cuda:01'}", "model.device: must be auto, cpu, cuda or cuda:N"),
    ("model: {device: CUDA}", "model.device: must be auto, cpu, cuda or cuda:N"),
    ("model: {chat_template_date: 2026-02-30}",
     "model.chat_template_date: cannot read '2026-02-30' at line 1, column 29: day is out of range for month"),
    ("- a\n- b", "expected a mapping of sections"),
    # a key given twice: YAML keeps the last silently (the first section's keys were lost)
    ("sampling: {seed: 1}\nsampling: {num_samples: 2}",
     "sampling: given twice, at line 1, column 1 and line 2, column 1 (a mapping holds each key once)"),
    ("sampling:\n  seed: 1\n  'seed': 2", "sampling.seed: given twice, at line 2, column 3 and line 3, column 3"),
    # tool parameters the chat template and the fingerprint take as JSON (they crashed, exit 1)
    ("tools: [{name: a, function: 'operator:add', parameters: {type: object, properties: {x: {default: 2026-01-01}}}}]",
     "tools.functions.0.parameters: must be JSON: properties.x.default: datetime.date(2026, 1, 1) is not a JSON value"),
    ("tools: [{name: a, function: 'operator:add', parameters: {type: object, properties: {1: {}, b: {}}}}]",
     "tools.functions.0.parameters: must be JSON: the key 1 in properties is not a string"),
])
def test_validation_messages_name_file_and_key(tmp_path, yaml_text, fragment):
    p = write(tmp_path, yaml_text)
    with pytest.raises(SpecError) as e:
        load_spec(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}: "), msg
    assert fragment in msg, msg


def test_several_errors_reported_together(tmp_path):
    with pytest.raises(SpecError) as e:
        load_spec(write(tmp_path, "sampling: {top_p: 2, temprature: 1}\ncluster: {num_workers: 0}\n"))
    msg = str(e.value)
    assert "sampling.top_p" in msg and "unknown key sampling.temprature" in msg and "cluster.num_workers" in msg


def test_missing_file_and_invalid_yaml(tmp_path):
    with pytest.raises(SpecError, match="config file not found"):
        load_spec(tmp_path / "nope.yaml")
    p = write(tmp_path, "sampling:\n  temperature: 1.0\n   top_p: [\n")
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert "invalid YAML at line" in str(e.value) and str(p) in str(e.value)
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)


def test_sampling_params_and_engine_kwargs(tmp_path):
    spec = load_spec(write(tmp_path, "sampling: {num_samples: 2, max_tokens: 9, temperature: 0, top_k: 0, "
                                     "stop_token_ids: [5]}\ntools: {calculator: false}\n"
                                     "model: {path: tiny-random, device: cpu, dtype: float32, max_num_seqs: 8, "
                                     "max_seq_len: 128}\n"))
    sp = spec.sampling_params()
    assert (sp.num_samples, sp.max_tokens, sp.temperature, sp.top_k, sp.stop_token_ids, sp.calculator) == \
        (2, 9, 0.0, 0, (5,), False)
    assert spec.engine_kwargs() == {"path": "tiny-random", "device": "cpu", "dtype": "float32", "tokenizer": None,
                                    "max_num_seqs": 8, "kv_cache_bytes": None, "max_seq_len": 128,
                                    "batch_invariant": True, "prefix_sharing": True, "prefix_caching": True,
                                    "tools": None}


def test_device_and_dtype_resolved_on_the_driver(tmp_path):
    """auto never depends on the machine the driver happens to run on: a CPU job is cpu on a
    GPU node too; dtype "auto" stays "auto", which each worker resolves for its own machine
    (bfloat16 only where native and faster; the run's workers must agree, cluster/health.py);
    the fingerprint names the device kind and dtype (so a resumed job cannot switch either,
    and "auto" is not the same job as an explicit dtype)."""
    cpu = load_spec(write(tmp_path, ""))
    gpu = load_spec(write(tmp_path, ""), ["cluster.gpus_per_worker=1"])
    assert (cpu.engine_kwargs()["device"], cpu.engine_kwargs()["dtype"]) == ("cpu", "auto")
    assert (gpu.engine_kwargs()["device"], gpu.engine_kwargs()["dtype"]) == ("cuda", "auto")
    assert cpu.fingerprint_dict()["model"]["device"] == "cpu" and gpu.fingerprint_dict()["model"]["dtype"] == "auto"
    bf16 = load_spec(write(tmp_path, ""), ["cluster.gpus_per_worker=1", "model.dtype=bf16"])
    assert bf16.engine_kwargs()["dtype"] == "bfloat16" and bf16.fingerprint_dict() != gpu.fingerprint_dict()
    assert cpu.fingerprint_dict() != gpu.fingerprint_dict()
    explicit = load_spec(write(tmp_path, ""), ["model.device=cuda:1", "model.dtype=fp16"])
    assert explicit.engine_kwargs()["device"] == "cuda:1" and explicit.fingerprint_dict()["model"]["device"] == "cuda"
    assert explicit.fingerprint_dict()["model"]["dtype"] == "float16"
    # aliases are the same job
    fp32 = load_spec(write(tmp_path, ""), ["model.dtype=fp32"])
    assert fp32.fingerprint_dict() == load_spec(write(tmp_path, ""), ["model.dtype=float32"]).fingerprint_dict()
    assert fp32.fingerprint_dict() != cpu.fingerprint_dict()


def test_fingerprint_dict_ignores_placement(tmp_path):
    a = load_spec(write(tmp_path, ""), ["output.path=x", "cluster.num_workers=1"]).fingerprint_dict()
    b = load_spec(write(tmp_path, ""), ["output.path=y", "cluster.num_workers=2", "cluster.address=auto",
                                        "model.max_num_seqs=3", "model.device=cpu",
                                        "cluster.unit_timeout_s=30", "output.lease_timeout_s=60",
                                        "model.prefix_sharing=false", "model.prefix_caching=false"]).fingerprint_dict()
    assert a == b
    c = load_spec(write(tmp_path, ""), ["sampling.seed=1"]).fingerprint_dict()
    d = load_spec(write(tmp_path, ""), ["cluster.unit_rows=7"]).fingerprint_dict()
    assert a != c and a != d


def test_model_identity_uses_names_and_sizes(tmp_path):
    import os
    import shutil

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model_000001.pt").write_bytes(b"x" * 10)
    (ck / "meta_000001.json").write_text("{}")
    copy = tmp_path / "copy"
    shutil.copytree(ck, copy)
    os.utime(copy / "model_000001.pt", (1, 1))
    fa = JobSpec.from_dict({"model": {"path": str(ck)}}).fingerprint_dict()
    fb = JobSpec.from_dict({"model": {"path": str(copy)}}).fingerprint_dict()
    assert fa == fb
    (copy / "model_000001.pt").write_bytes(b"x" * 11)
    assert JobSpec.from_dict({"model": {"path": str(copy)}}).fingerprint_dict() != fa


def test_shipped_configs_validate():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    demo = load_spec(root / "configs" / "demo.yaml")
    assert demo.input.path == "package://gsm8k_demo.parquet" and demo.model.path == "smollm2"
    gsm = load_spec(root / "configs" / "gsm8k.yaml")
    assert gsm.input.format == "chat" and gsm.input.passthrough == ["answer"] and gsm.tools.calculator


def test_model_device_takes_what_the_engine_takes(tmp_path):
    """model.device is auto, cpu, cuda or cuda:N (what engine.load_engine and torch.device
    take); anything else ('gpu', 'banana') is refused at validation, exit 2 naming
    model.device, where it used to pass plan and fail on the workers after the output
    directory was written."""
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        assert load_spec(write(tmp_path, ""), [f"model.device={device}"]).model.device == device
    for device in ("gpu", "banana", "cuda:", "cuda:x", "cpu:0", " cpu"):
        with pytest.raises(SpecError, match=r"model\.device: must be auto, cpu, cuda or cuda:N") as e:
            JobSpec.from_dict({"model": {"device": device}}, "job.yaml")
        assert e.value.exit_code == 2


def test_impossible_yaml_date_is_a_spec_error_naming_the_key_and_line(tmp_path):
    """An unquoted date that does not exist (2026-02-30) makes yaml.safe_load raise
    ValueError, not YAMLError: in a file and in --set it is a SpecError (exit 2) naming the
    file, line and dotted key, or the --set key, not a traceback. A string key given such a
    value by --set takes it as the string, as it does a number."""
    p = write(tmp_path, "model:\n  path: tiny-random\n  chat_template_date: 2026-02-30\n")
    with pytest.raises(SpecError) as e:
        load_spec(p)
    assert str(e.value).startswith(f"{p}: model.chat_template_date: cannot read '2026-02-30' at line 3, column 23")
    assert e.value.exit_code == 2
    with pytest.raises(SpecError, match=r"--set 'model.chat_template_date=2026-02-30': model.chat_template_date: "
                                        r"cannot read the value '2026-02-30': day is out of range"):
        load_spec(write(tmp_path, ""), ["model.chat_template_date=2026-02-30"])
    assert load_spec(write(tmp_path, ""), ["output.path=2026-02-30"]).output.path == "2026-02-30"
    assert load_spec(write(tmp_path, ""), ["output.path=2026-02-03"]).output.path == "2026-02-03"
    assert load_spec(write(tmp_path, "model: {chat_template_date: 2026-02-03}\n")).model.chat_template_date == \
        "2026-02-03"


def test_mapping_overrides_give_the_spec_set_strings_give(tmp_path):
    """load_job_spec applies a mapping {"section.key": value} to the config's own keys, as it
    does "--set" strings, before any default is filled in: the same spec either way, for a
    YAML path, a dict and a JobSpec. A default that follows another key follows the
    overridden value (input.column after input.format; OpenAI's num_samples 1, top_k off
    and max_tokens none for openai_batch), and a JobSpec loses nothing it was given."""
    from jobs.config import load_job_spec

    p = write(tmp_path, "model: {path: tiny-random}\ninput: {path: x.parquet}\nsampling: {temperature: 0.5}\n")
    base = {"model": {"path": "tiny-random"}, "input": {"path": "x.parquet"}, "sampling": {"temperature": 0.5}}
    for config in (p, base, load_spec(p)):
        chat = load_job_spec(config, {"input.format": "chat"})
        assert chat.to_dict() == load_job_spec(config, ["input.format=chat"]).to_dict()
        assert chat.input.column == "messages"
        batch = load_job_spec(config, {"input.format": "openai_batch"})
        assert batch.to_dict() == load_job_spec(config, ["input.format=openai_batch"]).to_dict()
        s = batch.sampling
        assert (s.num_samples, s.top_k, s.max_tokens, s.temperature) == (1, 0, None, 0.5)
        assert batch.input.column == "body"
        # and back: the filled-in defaults were not taken as given
        text = load_job_spec(batch, {"input.format": "text"})
        assert text.to_dict() == load_spec(p).to_dict()
        assert load_job_spec(chat, ["input.format=text"]).input.column == "prompt"
    # what the config did give stays given
    given = load_job_spec({"input": {"format": "chat", "column": "conv"}, "sampling": {"num_samples": 3}},
                          {"input.format": "tokens"})
    assert given.input.column == "conv" and given.sampling.num_samples == 3
    assert load_job_spec(given, {"input.format": "chat"}).input.column == "conv"
    # a dict config reads `tools: [...]` and empty sections as a YAML file does
    d = load_job_spec({"model": None, "tools": [{"name": "f", "function": "operator:add"}]}, ["tools.max_turns=2"])
    assert [f.name for f in d.tools.functions] == ["f"] and d.tools.max_turns == 2


def test_tools_max_response_chars_reaches_the_toolbox_and_the_fingerprint_only_when_set():
    """tools.max_response_chars is the ToolBox's bound (engine/tool_runner.py); the
    fingerprint holds it only when set, so outputs of jobs that never set it still resume;
    0 and non-integers stop the job (exit 2) naming the key."""
    from jobs.config import load_job_spec

    tools = [{"name": "f", "function": "operator:add"}]
    plain = load_job_spec({"model": None, "tools": tools})
    cut = load_job_spec({"model": None, "tools": tools}, ["tools.max_response_chars=500"])
    assert plain.tool_box().max_response_chars is None and cut.tool_box().max_response_chars == 500
    assert "max_response_chars" not in plain.fingerprint_dict()["tools"]
    assert cut.fingerprint_dict()["tools"]["max_response_chars"] == 500
    for bad in ("0", "1.5", "many"):
        with pytest.raises(SpecError, match="tools.max_response_chars"):
            load_job_spec({"model": None, "tools": tools}, [f"tools.max_response_chars={bad}"])


def test_tools_parallel_calls_reaches_the_toolbox_and_the_fingerprint_only_when_set():
    """tools.parallel_calls (engine/tool_turns.py) is the ToolBox's flag; the fingerprint holds
    it only when true, so outputs of jobs that never set it still resume; a value that is not
    a boolean stops the job (exit 2) naming the key."""
    from jobs.config import load_job_spec

    tools = [{"name": "f", "function": "operator:add"}]
    plain = load_job_spec({"model": None, "tools": tools})
    par = load_job_spec({"model": None, "tools": tools}, ["tools.parallel_calls=true"])
    assert plain.tool_box().parallel_calls is False and par.tool_box().parallel_calls is True
    assert "parallel_calls" not in plain.fingerprint_dict()["tools"]
    assert par.fingerprint_dict()["tools"]["parallel_calls"] is True
    assert load_job_spec({"model": None, "tools": {"parallel_calls": True}}).tool_box() is None  # no function tools
    with pytest.raises(SpecError, match="tools.parallel_calls") as e:
        load_job_spec({"model": None, "tools": tools}, ["tools.parallel_calls=many"])
    assert e.value.exit_code == 2


def test_load_job_spec_keeps_a_jobspecs_python_tools(tmp_path):
    """Python tools added to a JobSpec (with_python_tools) are objects, in no dump of the
    config: load_job_spec(spec), with or without overrides (what jobs.run_job(spec) and
    GenerationPool(spec) do first), keeps them, and still refuses a config tool of the same
    name set by an override."""
    from jobs.config import load_job_spec

    def add(a: int, b: int) -> int:
        "Add two numbers."
        return a + b

    spec = load_job_spec({"model": {"path": "tiny-random"}}).with_python_tools([add])
    for again, turns in ((load_job_spec(spec), 8), (load_job_spec(spec, {"sampling.seed": 1}), 8),
                         (load_job_spec(spec, ["tools.max_turns=3"]), 3)):
        box = again.tool_box()
        assert box is not None and [t.name for t in box.tools] == ["add"] and box.tools[0].function is add
        assert box.max_turns == turns
    assert load_job_spec(spec).fingerprint_dict() == spec.fingerprint_dict()
    with pytest.raises(SpecError, match="used twice"):
        load_job_spec(spec, {"tools.functions": [{"name": "add", "function": "operator:add"}]})


def test_merge_keys_may_override_and_anchors_are_read(tmp_path):
    """Keys a YAML merge (`<<: *anchor`) brings in may be given again (YAML defines the
    explicit one to win), unlike a key written twice."""
    spec = load_spec(write(tmp_path, "sampling: &s {seed: 3, num_samples: 2}\n"
                                     "cluster: {unit_rows: 5}\n"
                                     "model:\n  <<: {path: tiny-random, max_num_seqs: 4}\n  max_num_seqs: 6\n"))
    assert (spec.sampling.seed, spec.sampling.num_samples, spec.model.max_num_seqs) == (3, 2, 6)


def test_exponent_numbers_without_a_dot_are_numbers(tmp_path):
    """`temperature: 1e-5` in a config file or `--set sampling.temperature=1e-5`: a float, as
    YAML 1.2 and JSON read it. PyYAML's YAML 1.1 read `1e-5` (and `1.5e3`, whose exponent has
    no sign) as strings, which the job refused (exit 2, "must be a finite number"). Words that
    only look numeric stay strings, and a string key keeps what it is given."""
    cfg = tmp_path / "job.yaml"
    cfg.write_text("sampling:\n  temperature: 1e-5\n  top_p: 9.5e-1\n  min_p: .5E-1\n")
    s = load_spec(str(cfg)).sampling
    assert (s.temperature, s.top_p, s.min_p) == (1e-5, 0.95, 0.05)
    assert load_spec(str(cfg), ["sampling.temperature=2E-1"]).sampling.temperature == 0.2
    d: dict = {}
    for value in ("1e", "e5", "1e5x"):
        apply_override(d, f"sampling.stop={value}")
        assert d["sampling"]["stop"] == value
    apply_override(d, "output.path=1e5")
    assert d["output"]["path"] == "1e5"


@pytest.mark.parametrize("key", ["sampling.temperature", "output.lease_timeout_s", "cluster.unit_timeout_s"])
def test_an_integer_past_floats_range_is_a_bad_value_not_a_crash(key):
    """An integer too large for a float (10**400) given for a number: math.isfinite raised
    OverflowError out of the check (a traceback, exit 1, and in an OpenAI batch file the whole
    scan stopped on one line's "temperature"). Now a bad value named by key (exit 2), and the
    engine's check (per-row and batch-line parameters) a ValueError."""
    from engine.params import check_sampling_value
    from jobs.config import load_job_spec

    with pytest.raises(SpecError, match=key.replace(".", r"\.")) as e:
        load_job_spec({"model": None}, [f"{key}=1{'0' * 400}"])
    assert e.value.exit_code == 2
    for name in ("temperature", "top_p", "min_p"):
        with pytest.raises(ValueError, match="must be"):
            check_sampling_value(name, 10**400)
