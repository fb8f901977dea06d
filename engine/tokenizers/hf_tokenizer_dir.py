"""Read a Hugging Face tokenizer directory into an HFTokenizer, as transformers 5.x's
`AutoTokenizer.from_pretrained(dir)` reads it (tokenization_utils_base.py `_from_pretrained`,
tokenization_utils_tokenizers.py `TokenizersBackend.__init__`).

Files:
- tokenizer.json (required): the `tokenizers` pipeline, used as it is.
- tokenizer_config.json (optional): named special tokens (`bos_token`, `eos_token`, `unk_token`,
  `sep_token`, `pad_token`, `cls_token`, `mask_token`; strings or AddedToken dicts), model-specific
  `*_token` strings (template variables too), `added_tokens_decoder`, `additional_special_tokens` /
  `extra_special_tokens`, `chat_template` (a string, or a list of {"name", "template"}),
  `split_special_tokens`, `clean_up_tokenization_spaces`. `add_bos_token` is ignored when
  tokenizer.json is present (its post-processor decides), as in transformers.
- special_tokens_map.json (older directories): read when tokenizer_config.json has no
  `added_tokens_decoder`; its entries override the config's.
- chat_template.jinja and additional_chat_templates/<name>.jinja (transformers 4.43+): they win
  over the config's `chat_template`; chat_template.jinja is the "default" template.

Special tokens the config names but tokenizer.json does not hold as added tokens are added as
special tokens (at their vocabulary id when the text is a vocabulary token, else at the end), so
the text encodes to them, as in transformers.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"
# transformers' named special tokens (PreTrainedTokenizerBase.SPECIAL_TOKENS_ATTRIBUTES), in order.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_ADDED_TOKEN_FIELDS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any, where: str) -> str | None:
    """The text of a special-token entry: a string, an AddedToken dict, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: expected a string or an AddedToken object with a 'content' string, got {value!r}")


def _chat_templates(directory: Path, config: dict, config_path: Path) -> str | dict[str, str] | None:
    """The chat template(s): template files win over the config's `chat_template`."""
    templates: dict[str, str] = {}
    if (directory / CHAT_TEMPLATE_FILE).is_file():
        templates["default"] = (directory / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    extra = directory / CHAT_TEMPLATE_DIR
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ValueError(f"{config_path}: chat_template must be a string or a list of {{'name', 'template'}} objects")


def added_token(value: str | Mapping[str, Any], *, special: bool | None = None) -> AddedToken:
    """A tokenizers.AddedToken from a string or an AddedToken dict ({"content": ..., "lstrip": ...});
    `special` overrides the dict's flag. A string gives a special, unnormalized token."""
    if isinstance(value, str):
        return AddedToken(value, special=True if special is None else special, normalized=False)
    fields = {k: bool(value[k]) for k in _ADDED_TOKEN_FIELDS if k in value}
    if special is not None:
        fields["special"] = special
    if "normalized" not in fields:
        fields["normalized"] = not fields.get("special", False)
    return AddedToken(value["content"], **fields)


def read_tokenizer_dir(directory: Path, cls: type) -> Any:
    """An HFTokenizer (`cls`) from `directory` (see the module docstring).

    Raises FileNotFoundError without tokenizer.json, ValueError naming the file and key for
    malformed content, or an added token whose id disagrees with tokenizer.json.
    """
    tj = directory / TOKENIZER_JSON
    if not tj.is_file():
        raise FileNotFoundError(f"{directory}: no {TOKENIZER_JSON} (a Hugging Face tokenizer directory needs one)")
    try:
        backend = Backend.from_file(str(tj))
    except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception for malformed files
        raise ValueError(f"{tj}: not a tokenizers file ({e})") from None
    config_path = directory / TOKENIZER_CONFIG
    config = _read_json(config_path) if config_path.is_file() else {}
    stm_path = directory / SPECIAL_TOKENS_MAP
    if "added_tokens_decoder" not in config and stm_path.is_file():
        config.update(_read_json(stm_path))  # transformers: special_tokens_map.json entries win here

    # tokens tokenizer_config.json declares with their ids
    declared = config.get("added_tokens_decoder") or {}
    if not isinstance(declared, dict):
        raise ValueError(f"{config_path}: added_tokens_decoder must be an object mapping ids to tokens")
    for key in sorted(declared, key=lambda k: int(k) if str(k).isdigit() else -1):
        entry = declared[key]
        where = f"{config_path}: added_tokens_decoder[{key!r}]"
        if not str(key).isdigit() or not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{where}: expected an integer id mapping to an AddedToken object with 'content'")
        backend.add_tokens([added_token(entry)])
        got = backend.token_to_id(entry["content"])
        if got != int(key):
            raise ValueError(f"{where}: {entry['content']!r} has id {got} in {tj}, not {key}")

    # named, extra and model-specific special tokens; missing ones become special added tokens
    variables: dict[str, str] = {}
    specials: list[Any] = []
    for name in NAMED_SPECIAL_TOKENS:
        text = _token_text(config.get(name), f"{config_path}: {name}")
        if text is not None:
            variables[name] = text
            specials.append(config[name])
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra, dict):  # transformers 5: {"image_token": "<image>", ...}
        for name, value in extra.items():
            variables[name] = _token_text(value, f"{config_path}: extra_special_tokens.{name}")
            specials.append(value)
    elif isinstance(extra, list):
        for i, value in enumerate(extra):
            _token_text(value, f"{config_path}: additional_special_tokens[{i}]")
            specials.append(value)
    else:
        raise ValueError(f"{config_path}: additional_special_tokens must be a list (or extra_special_tokens an object)")
    for name, value in config.items():
        if name.endswith("_token") and name not in NAMED_SPECIAL_TOKENS and isinstance(value, str):
            variables[name] = value
            specials.append(value)
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    for value in specials:
        tok = added_token(value, special=True)
        if tok.content not in known:
            backend.add_special_tokens([tok])
            known.add(tok.content)

    split = config.get("split_special_tokens", False)
    if not isinstance(split, bool):
        raise ValueError(f"{config_path}: split_special_tokens must be true or false")
    backend.encode_special_tokens = split
    return cls(backend, special_tokens_map=variables, chat_template=_chat_templates(directory, config, config_path),
               clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
               name=str(directory))


__all__ = ["read_tokenizer_dir", "added_token", "NAMED_SPECIAL_TOKENS", "TOKENIZER_JSON", "TOKENIZER_CONFIG",
           "CHAT_TEMPLATE_FILE"]
