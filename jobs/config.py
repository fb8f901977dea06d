"""A job config read into a JobSpec (jobs/spec.py): from a YAML file, a dict of sections or a
JobSpec, with overrides.

    spec = load_spec("configs/demo.yaml", ["sampling.temperature=0.7"])    # the CLI: a file and --set
    spec = load_job_spec({"model": {...}}, {"sampling.seed": 3})             # Python: any form, values as given

`--set a.b=value` overrides any key, its value parsed as YAML. Errors are SpecError (exit
code 2) naming the file and the dotted key.
"""
from __future__ import annotations

import copy
import datetime
import re
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from jobs.errors import SpecError, shown, shown_key
from jobs.spec import JobSpec, spec_sections


class ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader that reads a number in exponent form without a dot (`1e-5`, `2E3`) as
    a float, as YAML 1.2 and JSON do: PyYAML follows YAML 1.1, whose float needs a dot and a
    signed exponent, so `temperature: 1e-5` (or 1.5e3) was a string the job refused as not a
    number."""


ConfigLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                   re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
                                   list("-+.0123456789"))


def set_origin(override: str) -> str:
    """How messages name the `--set` override `override`: `--set 'KEY=VALUE'` (bounded)."""
    return f"--set {shown(override)}"


def apply_override(data: dict[str, Any], override: str, source: str = "--set") -> str:
    """Apply one `a.b=value` override to the raw config dict in place; returns its key, "a.b".

    The value is parsed as YAML (ConfigLoader: "0.7" -> 0.7, "1e-5" -> 1e-05, "[1,2]" -> [1, 2],
    "null" -> None, "" -> None). Raises SpecError for a malformed override or an unknown key path.
    """
    given = set_origin(override)
    if "=" not in override:
        raise SpecError(f"{given}: expected KEY=VALUE, e.g. sampling.temperature=0.7")
    key, _, raw = override.partition("=")
    key = key.strip()
    parts = key.split(".")
    if len(parts) != 2 or not all(parts):
        raise SpecError(f"{given}: expected SECTION.KEY=VALUE (e.g. sampling.temperature=0.7), got key {shown(key)}")
    section, name = parts
    sections = spec_sections()
    if section not in sections:
        raise SpecError(f"{given}: unknown key {shown_key(key)} (sections: {', '.join(sections)})")
    fields = sections[section].model_fields
    if name not in fields:
        raise SpecError(f"{given}: unknown key {shown_key(key)} (keys of {section}: {', '.join(fields)})")
    is_str = fields[name].annotation in (str, str | None)
    try:
        value = yaml.load(raw, Loader=ConfigLoader) if raw.strip() else None
    except yaml.YAMLError as e:
        raise SpecError(f"{given}: {key}: value is not valid YAML: {e}") from None
    except (ValueError, TypeError) as e:
        # YAML resolved a scalar to a type it then cannot build: an impossible date, 2026-02-30
        if not is_str:
            raise SpecError(f"{given}: {key}: cannot read the value {shown(raw.strip())}: {e}") from None
        value = raw.strip()
    if isinstance(value, (int, float, bool, datetime.date)) and is_str:
        value = raw.strip()  # `--set output.path=2024` (or 2024-01-01) means the string
    sec = data.get(section)
    if sec is None:
        sec = data[section] = {}
    if not isinstance(sec, dict):
        raise SpecError(f"{source}: {section}: must be a mapping, got {shown(sec)}")
    sec[name] = value
    return key


def read_config(path: str | Path) -> dict[str, Any]:
    """The sections of the YAML file `path` as given (no defaults filled in; `tools: [...]`
    becomes `tools: {functions: [...]}`, an empty section {}), unvalidated past that.

    Raises SpecError (exit code 2) for a missing or unreadable file, invalid YAML (with
    line and column), a value YAML cannot build (an impossible date: with its key and line),
    a key given twice in one mapping (with its key and lines), something else than a mapping
    of sections, or an unknown section.
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpecError(f"{source}: config file not found") from None
    except IsADirectoryError:
        raise SpecError(f"{source}: is a directory, expected a YAML config file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise SpecError(f"{source}: cannot read config: {e}") from None
    try:
        data = yaml.load(text, Loader=ConfigLoader)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise SpecError(f"{source}: invalid YAML{where}: {problem}") from None
    except (ValueError, TypeError) as e:
        # not YAMLError: the text parses, but a scalar resolves to a type that cannot hold it
        # (unquoted `chat_template_date: 2026-02-30` is a timestamp, and no such day exists)
        raise SpecError(f"{source}: {_unbuildable_value(text, e)}") from None
    duplicate = _duplicate_key(text)
    if duplicate:
        raise SpecError(f"{source}: {duplicate}") from None
    return normalise_sections(data, source)


def _duplicate_key(text: str) -> str | None:
    """The message for a key given twice in one mapping (yaml.safe_load keeps the last one
    silently: a second `sampling:` section would drop the first's keys), naming its dotted
    key path and both lines; None if there is none. Keys a merge (`<<: *anchor`) brings in
    may be overridden, as YAML defines."""
    try:
        root = yaml.compose(text, Loader=ConfigLoader)
    except yaml.YAMLError:
        return None
    builder = ConfigLoader("")
    seen: set[int] = set()  # nodes walked (an alias repeats a node)

    def walk(node: yaml.Node | None, path: list[str]) -> str | None:
        if node is None or id(node) in seen:
            return None
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            return next((d for i, v in enumerate(node.value) if (d := walk(v, path + [str(i)]))), None)
        if not isinstance(node, yaml.MappingNode):
            return None
        first: dict[Any, yaml.Node] = {}
        for k, v in node.value:
            if not isinstance(k, yaml.ScalarNode) or k.tag == "tag:yaml.org,2002:merge":
                continue
            try:
                key = builder.construct_object(k, deep=True)
                hash(key)
            except (ValueError, TypeError, yaml.YAMLError):
                continue
            if key in first:
                a, b = first[key].start_mark, k.start_mark
                return (f"{'.'.join(path + [str(key)])}: given twice, at line {a.line + 1}, column {a.column + 1} "
                        f"and line {b.line + 1}, column {b.column + 1} (a mapping holds each key once)")
            first[key] = k
        return next((d for k, v in node.value if (d := walk(v, path + [str(getattr(k, "value", "?"))]))), None)

    return walk(root, [])


def _unbuildable_value(text: str, error: Exception) -> str:
    """The message for a value yaml.safe_load could not build (ValueError/TypeError, which
    carry no position): the first scalar that fails again on its own, named by its dotted
    key path, line and column; else the error alone."""
    try:
        root = yaml.compose(text, Loader=ConfigLoader)
    except yaml.YAMLError:
        root = None
    builder = ConfigLoader("")

    def fails(node: yaml.Node) -> bool:
        try:
            builder.construct_object(node, deep=True)
        except (ValueError, TypeError, yaml.YAMLError):
            return True
        return False

    def walk(node: yaml.Node | None, path: list[str]) -> tuple[list[str], yaml.Node] | None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                name = k.value if isinstance(k, yaml.ScalarNode) else "?"
                if isinstance(k, yaml.ScalarNode) and fails(k):
                    return path + [name], k
                found = walk(v, path + [name])
                if found:
                    return found
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                found = walk(v, path + [str(i)])
                if found:
                    return found
        elif isinstance(node, yaml.ScalarNode) and fails(node):
            return path, node
        return None

    found = walk(root, [])
    if found is None:
        return f"invalid value: {error}"
    path, node = found
    mark = node.start_mark
    return (f"{'.'.join(path) or '<top>'}: cannot read {shown(node.value)} at line {mark.line + 1}, column "
            f"{mark.column + 1}: {error} (quote it to give a string)")


def normalise_sections(data: Any, source: str) -> dict[str, Any]:
    """`data` (a parsed config; changed in place) with `tools: [...]` as `tools: {functions:
    [...]}` and an empty section as {}; SpecError for something else than a mapping of
    known sections, each a mapping."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpecError(f"{source}: expected a mapping of sections (model, input, output, sampling, tools, "
                        f"cluster), got {type(data).__name__}")
    if isinstance(data.get("tools"), list):  # `tools: [{name, function, ...}]` lists the function tools
        data["tools"] = {"functions": data["tools"]}
    for key, value in data.items():
        if key not in spec_sections():
            raise SpecError(f"{source}: unknown key {shown_key(key)} (sections: {', '.join(spec_sections())})")
        if value is not None and not isinstance(value, dict):
            raise SpecError(f"{source}: {key}: must be a mapping, got {shown(value)}")
        if value is None:
            data[key] = {}
    return data


def load_spec(path: str | Path, overrides: Iterable[str] = ()) -> JobSpec:
    """Read, override and validate a job config.

    path: the YAML file. overrides: "section.key=value" strings (the CLI's --set), applied
    in order after reading. Nothing is checked on disk except the file itself (inputs are
    checked by jobs.plan.planner.plan_job). Raises SpecError (exit code 2) for a missing or
    unreadable file, invalid YAML (with line and column), an unknown key or a bad value;
    the message names the file and the dotted key, or the --set override that gave the value.
    """
    data = read_config(path)
    origins = {apply_override(data, ov, str(path)): set_origin(ov) for ov in overrides}
    return JobSpec.from_dict(data, str(path), origins)


def load_job_spec(config: str | Path | Mapping[str, Any] | Any,
                  overrides: Iterable[str] | Mapping[str, Any] = ()) -> JobSpec:
    """A validated JobSpec from a YAML path, a dict of sections or a JobSpec, with overrides:
    "section.key=value" strings (values parsed as YAML, as `--set`), or a mapping
    {"section.key": value} (values used as given). Raises SpecError naming the key.

    The overrides apply to the keys the config gives (a JobSpec's given_dict: no defaults
    filled in), then everything is validated once, so a default that follows another key
    (input.column, openai_batch's sampling defaults) follows the overridden value, whichever
    form the overrides take. A JobSpec's Python tools (with_python_tools) are kept."""
    if isinstance(overrides, Mapping):
        sets: list[tuple[str, Any]] = list(overrides.items())
        strings: list[str] = []
    else:
        sets, strings = [], list(overrides)
    python_tools: list = []
    if isinstance(config, (str, Path)):
        data, source = read_config(config), str(config)
    elif isinstance(config, JobSpec):
        data, source = config.given_dict(), config.source
        python_tools = list(config._python_tools)  # objects, not config keys: not in any dump
    elif isinstance(config, Mapping):
        data, source = copy.deepcopy(dict(config)), "<dict>"
        data = normalise_sections(data, source)
    else:
        raise SpecError(f"run_job: config must be a YAML path, a dict or a JobSpec, got {type(config).__name__}")
    origins = dict(config._origins) if isinstance(config, JobSpec) else {}  # what set its keys, kept
    origins.update({apply_override(data, ov, source): set_origin(ov) for ov in strings})
    for key, value in sets:
        _set(data, key, value, source)
        origins[key.strip()] = f"override {key.strip()}={shown(value)}"
    spec = JobSpec.from_dict(data, source, origins)
    # with_python_tools checks their names again, against the tools.functions overrides may have set
    return spec.with_python_tools(python_tools) if python_tools else spec


def _set(data: dict[str, Any], key: str, value: Any, source: str) -> None:
    # check the key path as --set does, then put the value itself (not its YAML text)
    apply_override(data, f"{key}=null", source)
    section, name = key.split(".")
    data[section][name] = value
