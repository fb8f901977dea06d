"""The `batchgen` command line (console script `batchgen` = jobs.cli:main).

    batchgen run CONFIG [--set KEY=VALUE ...] [--overwrite]
    batchgen plan CONFIG [--set KEY=VALUE ...]
    batchgen run-batch -i IN.jsonl -o OUT.jsonl [--model PATH] [--config CONFIG] [--output-dir DIR]
                       [--set KEY=VALUE ...] [--overwrite]
    batchgen submit CONFIG --address http://HEAD:8265 [--set KEY=VALUE ...] [--overwrite]
    batchgen status OUTPUT [--json]
    batchgen verify OUTPUT [--complete]
    batchgen prepare INPUT.jsonl OUTPUT.parquet [--column question] [--id-column NAME] [--format text|chat]
                     [--row-group-rows 256]
    batchgen export MODEL --out DIR [--format onnx|pt2] [--dtype float32|float16] [--static-max-len N]
                    [--verify] [--max-tokens 32]
    batchgen --version

Exit codes: 0 success; 1 the job ran and failed, or `verify` found problems; 2 the job
could not start (bad config, bad input, output belongs to another job or is in use by
another driver, bad prepare input, bad export options or model; `plan` returns 2 where `run`
would stop; `status` or `verify` with no output to read; `verify --complete` returns 1 for an
unfinished output too); `export --verify` returns 1 when
the artifact does not generate the engine's tokens; 130 interrupted. Every jobs.errors.JobError is printed as "error: <message>" on stderr.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any, Sequence

from jobs.errors import JobError


def _distribution_version(name: str) -> str | None:
    """The installed version of distribution `name` (importlib.metadata), None if it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _source_version() -> str | None:
    """The [project] version of the pyproject.toml beside the `jobs` package (a checkout run
    without being installed: PYTHONPATH=.), None if there is none."""
    import re
    from pathlib import Path

    try:
        text = (Path(__file__).resolve().parent.parent / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if project is None or not re.search(r'^name\s*=\s*"batchgen"\s*$', project.group(1), re.M):
        return None
    m = re.search(r'^version\s*=\s*"([^"]+)"\s*$', project.group(1), re.M)
    return m.group(1) if m else None


def version_line() -> str:
    """`batchgen --version`: "batchgen <version> (torch <version>, python <version>)". The
    versions come from the installed distributions' metadata, so nothing is imported: no
    torch, no engine, no kernels compiled. batchgen's is the pyproject.toml's beside the code
    that runs (a checkout, run with PYTHONPATH=. or installed editable: the metadata is the
    version at install time, or another installed batchgen's), else its metadata (installed)."""
    import platform

    ours = _source_version() or _distribution_version("batchgen") or "unknown"
    torch = _distribution_version("torch") or "not installed"
    return f"batchgen {ours} (torch {torch}, python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """argparse's `version` action, the line computed only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, values: Any, option_string: Any = None) -> None:
        print(version_line())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batchgen", description="Distributed batch generation: Parquet prompts in, "
                                "one Parquet row per sample out.")
    p.add_argument("--version", action=_VersionAction,
                   help="print batchgen's version, with torch's and python's, and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add_set(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set sampling.temperature=0.7 (repeatable; the "
                             "value is parsed as YAML)")

    r = sub.add_parser("run", help="run a job (locally, or on the Ray cluster in cluster.address)")
    r.add_argument("config", help="job YAML file")
    add_set(r)
    r.add_argument("--overwrite", action="store_true",
                   help="start over where run would refuse output.path (another job's output, retrained "
                        "weights, a damaged manifest, other files): deletes batchgen's files there, "
                        "never the others")

    pl = sub.add_parser("plan", help="validate a job and print what `run` would do (no Ray, no model)")
    pl.add_argument("config", help="job YAML file")
    add_set(pl)
    rb = sub.add_parser("run-batch", help="answer an OpenAI Batch JSONL file (as vLLM's run-batch)",
                        description="Run an OpenAI Batch file (/v1/chat/completions and /v1/completions lines) as a "
                                    "resumable batchgen job and write one response line per request line, in input "
                                    "order. The Parquet dataset (--output-dir) is the durable store: rerun the same "
                                    "command after an interruption to resume.")
    rb.add_argument("-i", "--input", required=True, help="the batch file (JSONL, one request a line)")
    rb.add_argument("-o", "--output", required=True, help="the response file to write (JSONL)")
    rb.add_argument("--model", default=None, help="model.path (default: the config's, else smollm2)")
    rb.add_argument("--config", default=None, help="a job YAML for the model, sampling defaults and cluster keys")
    rb.add_argument("--output-dir", default=None,
                    help="the job's Parquet output directory (default: OUTPUT without .jsonl, plus .parquet)")
    add_set(rb)
    rb.add_argument("--overwrite", action="store_true", help="as for run")

    s = sub.add_parser("submit", help="submit a job to a Ray cluster's job server")
    s.add_argument("config", help="job YAML file")
    s.add_argument("--address", required=True, help="Ray dashboard address, e.g. http://HEAD:8265")
    add_set(s)
    s.add_argument("--overwrite", action="store_true", help="as for run")

    st = sub.add_parser("status", help="progress of a job, from its output directory")
    st.add_argument("output", help="output directory (output.path)")
    st.add_argument("--json", action="store_true", help="print the status as JSON")

    v = sub.add_parser("verify", help="check an output directory; exit 1 if anything is wrong",
                       description="Check an output directory's integrity: nothing wrong in what is there (an "
                                   "interrupted job's partial output passes, and the verdict says it is incomplete). "
                                   "Exit 1 on a problem.")
    v.add_argument("output", help="output directory (output.path)")
    v.add_argument("--complete", action="store_true",
                   help="also count an unfinished output (units missing or no _SUCCESS) as a problem: for scripts "
                        "that check a job before using its output")

    pr = sub.add_parser("prepare", help="turn a JSONL file into a prompts Parquet file")
    pr.add_argument("input", help="JSONL file, one JSON object a line")
    pr.add_argument("output", help="Parquet file to write")
    pr.add_argument("--column", default="prompt", help="the JSON field holding the prompt text (default: prompt)")
    pr.add_argument("--id-column", default=None,
                    help="a JSON field holding unique prompt ids, kept as a column; if no line has it, "
                         "the column is created from line numbers (1-based)")
    pr.add_argument("--format", choices=("text", "chat"), default="text",
                    help="text: a string column `prompt`; chat: a `messages` column [{role: user, content}]")
    pr.add_argument("--row-group-rows", type=int, default=256, metavar="N",
                    help="rows per Parquet row group (default 256): use the job's cluster.unit_rows, so that "
                         "each unit decodes only its own rows")

    ex = sub.add_parser("export", help="export a model with its KV cache as explicit inputs/outputs (ONNX, pt2)")
    ex.add_argument("model", help="what model.path takes: a checkpoint directory, a .gguf file, smollm2, tiny-random")
    ex.add_argument("--out", required=True, help="directory to create (absent or empty)")
    ex.add_argument("--format", default="onnx", help="onnx (default) or pt2 (torch.export + AOTInductor, static)")
    ex.add_argument("--dtype", default="float32", help="float32 (default) or float16: weights and KV")
    ex.add_argument("--static-max-len", type=int, default=None, metavar="N",
                    help="fixed KV buffers of N positions written in place (one graph for every position)")
    ex.add_argument("--verify", action="store_true",
                    help="greedy loop in the artifact against the engine before the directory is created")
    ex.add_argument("--max-tokens", type=int, default=None, metavar="N",
                    help="with --verify (not read without it): tokens the verification generates per prompt, "
                         "at least 2 (the first is the prefill's, the second the first decode step's, which "
                         "reads the KV cache back in; below 2: exit 2) (default 32, fewer where the model's "
                         "context is shorter than the longest prompt, 21, plus 32; more than it holds: exit 2)")
    return p


# ------------------------------------------------------------------ run-batch

def batch_output_dir(output: str) -> str:
    """run-batch's default Parquet directory for response file `output`: results.jsonl -> results.parquet."""
    stem = output[: -len(".jsonl")] if output.endswith(".jsonl") else output
    return stem + ".parquet"


def batch_spec(input_path: str, output: str, *, model: str | None = None, config: str | None = None,
               output_dir: str | None = None, overrides: Sequence[str] = ()) -> Any:
    """The JobSpec `batchgen run-batch` runs: the config's keys (if any), --model, the --set
    overrides, then input.path = the batch file, input.format = openai_batch and output.path =
    `output_dir` (default batch_output_dir(output)). Raises SpecError naming the key, or when
    `output` is the input file: the responses, written once the job is done, would replace the
    requests."""
    import copy

    from jobs.config import apply_override, read_config, set_origin
    from jobs.errors import SpecError, shown
    from jobs.spec import JobSpec

    if _same_file(input_path, output):
        from jobs import uri

        raise SpecError(f"run-batch: -o {uri.redact(output)} is the input file -i {uri.redact(input_path)}; the "
                        f"responses would replace the requests (name another response file)")
    source = config or "run-batch"
    data: dict[str, Any] = {}
    if config:
        # the keys it sets, read as `load_spec` reads them (`tools: [...]` included); unset ones
        # keep openai_batch's defaults
        data = read_config(config)
        JobSpec.from_dict(copy.deepcopy(data), source)  # the config's own errors first, naming its keys
    origins: dict[str, str] = {}
    if model is not None:
        data.setdefault("model", {})["path"] = model
        origins["model.path"] = f"--model {shown(model)}"
    for ov in overrides:
        origins[apply_override(data, ov, source)] = set_origin(ov)
    inp = data.setdefault("input", {})
    for key in ("column", "id_column", "sampling_column", "passthrough"):
        inp.pop(key, None)
    inp.update({"path": input_path, "format": "openai_batch"})
    data.setdefault("output", {})["path"] = output_dir or batch_output_dir(output)
    origins.pop("input.path", None)
    origins.pop("input.format", None)
    origins["output.path"] = f"--output-dir {shown(output_dir)}" if output_dir else f"-o {shown(output)}"
    return JobSpec.from_dict(data, source, origins)


def _same_file(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one file: local paths after resolving symbolic links (or
    one file under two hard links), URIs by their location without credentials or options."""
    import os

    from jobs import uri

    if uri.is_uri(a) or uri.is_uri(b):
        return uri.split_query(uri.redact(a))[0] == uri.split_query(uri.redact(b))[0]
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def run_batch(input_path: str, output: str, *, model: str | None = None, config: str | None = None,
              output_dir: str | None = None, overrides: Sequence[str] = (), overwrite: bool = False,
              progress: bool | None = None) -> int:
    """`batchgen run-batch`: the job of batch_spec (resumed if it ran before), then the
    response JSONL `output` written from its dataset. Returns 0; raises the job's errors."""
    from jobs import uri
    from jobs.outputs.batch_responses import write_responses
    from jobs.runner import run_job

    spec = batch_spec(input_path, output, model=model, config=config, output_dir=output_dir, overrides=overrides)
    run_job(spec, overwrite=overwrite, progress=progress)
    n = write_responses(spec.output.path, output)
    print(f"wrote {n} responses to {uri.redact(output)}")
    return 0


# ------------------------------------------------------------------ status

def format_status(st: dict[str, Any]) -> str:
    """The status dict of OutputDir.status as human-readable lines."""
    def pct(a: int, b: int) -> str:
        return f"{100.0 * a / b:.1f}%" if b else "100.0%"

    n = st.get("rows_expected") or 0
    lines = [
        f"output:           {st['path']}",
        f"fingerprint:      {st['fingerprint'][:16]}",
        f"units:            {st['units_done']}/{st['units_total']} committed ({pct(st['units_done'], st['units_total'])})",
        f"prompts:          {st['prompts']:,}/{(st.get('prompts_total') or 0):,}",
        f"rows:             {st['rows']:,}/{n:,}",
        f"generated tokens: {st['generated_tokens']:,}",
        f"prompt tokens:    {st['prompt_tokens']:,}",
        f"error rows:       {st['error_rows']:,}",
        f"tool calls:       {st['tool_calls']:,} ({st['tool_errors']:,} with errors)",
        f"input decoded:    {st.get('input_rows_decoded', 0):,} rows for {st['prompts']:,} prompts",
    ]
    if st.get("temp_files"):
        lines.append(f"temp files:       {st['temp_files']} (interrupted writes; resuming the job removes them)")
    for u in st.get("unreadable_units") or []:
        lines.append(f"unreadable:       {u}")
    lease = st.get("lease")
    if lease:
        lines.append(f"lease:            held by {lease.get('holder')} since {lease.get('acquired')}")
    lines.append(f"success marker:   {'yes' if st['success'] else 'no'}")
    return "\n".join(lines)


# ------------------------------------------------------------------ main

def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (see the module docstring)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except JobError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader left (`batchgen status OUT | head -3`): no traceback, and none at exit when
        # Python flushes stdout into the closed pipe (the Python docs' recipe, signal's SIGPIPE note)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, as a shell reports a writer the pipe closed on


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "run":
        from jobs.config import load_spec

        spec = load_spec(args.config, args.set)
        from jobs.runner import run_job

        return int(run_job(spec, overwrite=args.overwrite) or 0)
    if args.command == "plan":
        from jobs.config import load_spec
        from jobs.plan.report import describe_plan

        text, code = describe_plan(load_spec(args.config, args.set))
        print(text)
        return code
    if args.command == "run-batch":
        return run_batch(args.input, args.output, model=args.model, config=args.config, output_dir=args.output_dir,
                         overrides=list(args.set), overwrite=args.overwrite)
    if args.command == "submit":
        from jobs.config import load_spec

        load_spec(args.config, args.set)  # fail fast (exit 2) before contacting the cluster
        from jobs.submit import submit_job

        return int(submit_job(args.config, address=args.address, overrides=list(args.set),
                              overwrite=args.overwrite) or 0)
    if args.command == "status":
        from jobs.outputs.output_dir import OutputDir

        st = OutputDir(args.output).status()
        print(json.dumps(st, indent=1, default=str) if args.json else format_status(st))
        return 0
    if args.command == "verify":
        from jobs.outputs.layout import SUCCESS
        from jobs.outputs.output_dir import OutputDir

        od = OutputDir(args.output)
        problems = od.verify()
        done, total, success = (0, 0, False) if problems else od.completion()
        finished = success and done == total
        unfinished = (f"{done} of {total} units committed; incomplete: no {SUCCESS}, the job has not finished: "
                      f"run it again to resume")
        if not problems and not finished and args.complete:
            problems = [f"{od.shown}: {unfinished}"]
        for p in problems:
            print(p)
        if problems:  # od.shown: a URI's credentials are never printed
            print(f"{len(problems)} problem(s) in {od.shown}", file=sys.stderr)
            return 1
        print(f"ok: {od.shown} ({f'{done} of {total} units committed; complete' if finished else unfinished})")
        return 0
    if args.command == "prepare":
        from jobs.inputs.prepare import prepare_jsonl

        n = prepare_jsonl(args.input, args.output, column=args.column, id_column=args.id_column, fmt=args.format,
                          row_group_rows=args.row_group_rows)
        print(f"wrote {n} prompts to {args.output}")
        return 0
    if args.command == "export":
        return export_model(args)
    raise AssertionError(args.command)  # pragma: no cover - argparse rejects unknown commands


def export_model(args: argparse.Namespace) -> int:
    """`batchgen export` (the work is engine/export): 2 for bad options or a model that cannot be
    loaded or exported, 1 for a failed verification; nothing is written in either case."""
    from engine.export import ExportError, VerificationError, export
    from engine.loading.errors import CheckpointError

    try:
        record = export(args.model, args.out, format=args.format, dtype=args.dtype,
                        static_max_len=args.static_max_len, verify=args.verify, max_tokens=args.max_tokens)
    except (ExportError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except VerificationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {record['file']}, {len(record['tokenizer_files'])} tokenizer file(s)"
          f"{', genai_config.json' if record['genai_config'] else ''}, batchgen_export.json")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
