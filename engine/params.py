"""The engine's request and result types: SamplingParams in, Sample out.

These are plain dataclasses so that they pickle cheaply across Ray and convert
to Arrow rows without any tensor in them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to sample one prompt's continuations (per request; one batch may mix them).

    Fields:
        num_samples: continuations per prompt (>= 1). The prompt is prefilled once and its
            KV cache fanned out to `num_samples` slots.
        max_tokens: most tokens generated per sample (>= 1), forced tool-output tokens
            included; the model's context window also ends a sample (finish_reason "length").
            None: no limit but the context window (max_seq_len minus the prompt), as the
            OpenAI chat API does without max_tokens.
        temperature: 0, or anything below 1e-5, is greedy (argmax, as vLLM: logits / T would
            overflow float32 near 1e-38); otherwise it divides the logits before sampling.
        top_k: keep the k most likely tokens; 0 (or None) keeps all.
        top_p: nucleus sampling, keep the smallest set whose probability reaches top_p;
            in (0, 1], 1 keeps all.
        min_p: drop tokens whose probability is below min_p * p(most likely token); in [0, 1).
        seed: with (prompt_id, sample_index, position) it keys the sampling noise, so a
            sample is the same whatever the batch it runs in (see engine/sampling.py).
        stop_token_ids: None means the model's default stop tokens; [] means none. A sample
            that samples one ends with it: the token is kept in Sample.tokens (mask 1, with
            its logprob), as verl, TRL and vLLM expect, so a trainer can score the choice to stop.
        stop: stop strings (None or a tuple of non-empty strings; a single string is one stop
            string). A sample ends at the token that completes one of them in its decoded text;
            its tokens are all kept, the text ends before the stop string
            (engine/tokenizers/stop_strings.py).
        logprobs_mode: "raw" (log_softmax of the model's raw logits, temperature 1, no
            truncation: what a trainer recomputes from the weights) or "processed" (the
            log-probability under the distribution the token was drawn from, after temperature,
            top_k, top_p and min_p; 0 for greedy: what importance-sampling corrections need).
        top_logprobs: 0 (off) or k in 1..20 (OpenAI's bound; vLLM's logprobs=k): each sampled
            token's position also reports the k most likely tokens and their logprobs, under
            the distribution `logprobs_mode` names (Sample.top_logprob_ids / top_logprobs).
        calculator: run the calculator tool on <|python_start|>...<|python_end|> spans.
        skip_special_tokens: the text stop strings are matched on, as vLLM's skip_special_tokens
            makes it. False: the sampled text with special tokens' text (what Sample's decode,
            the `text` column, shows; vLLM with skip_special_tokens false), so "<|im_start|>"
            ends a sample at a sampled <|im_start|>. True: without it (vLLM's default, what an
            OpenAI batch line's content shows): a special token (tokenizer.special_tokens)
            neither completes a stop string nor breaks one that spans it.

    top_k, top_p and min_p apply to the temperature-scaled distribution (as in vLLM and
    Hugging Face). Raises ValueError naming the field for an invalid value.
    """

    num_samples: int = 1
    max_tokens: int | None = 256
    temperature: float = 1.0
    top_k: int | None = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    stop_token_ids: tuple[int, ...] | list[int] | None = None
    stop: tuple[str, ...] | list[str] | str | None = None
    logprobs_mode: str = "raw"
    calculator: bool = True
    skip_special_tokens: bool = False  # not a job `sampling` key: an OpenAI batch line's own
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        for name in SAMPLING_FIELDS:
            try:
                object.__setattr__(self, name, check_sampling_value(name, getattr(self, name)))
            except ValueError as e:
                raise ValueError(f"SamplingParams.{name}: {e}") from None
        if not isinstance(self.skip_special_tokens, bool):
            raise ValueError(f"SamplingParams.skip_special_tokens: must be true or false, got "
                             f"{shown(self.skip_special_tokens)}")


# A prompt's samples are one request's rows, held together until they are written: a bound
# far above any use (OpenAI's n stops at 128) that keeps a typo (1e12) an error row, not a
# MemoryError that fails its unit and then the job
MAX_NUM_SAMPLES = 1_000_000


# Most characters of an offending value that a message echoes: a 5 MB string given for a number
# was echoed whole (the console, the output's error column)
MAX_SHOWN_CHARS = 200


def shown(value: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """repr(value) for a message, bounded: its first `limit` characters, then
    "... (N characters)" (N: the string's length for a str, else its repr's). An integer
    too long for repr (Python refuses over 4,300 digits) is "an integer of N bits"."""
    try:
        text = repr(value)
    except ValueError:  # int.__repr__ past sys.get_int_max_str_digits
        return f"an integer of {value.bit_length():,} bits" if isinstance(value, int) else object.__repr__(value)
    except Exception as e:  # noqa: BLE001 - a repr that raises (or nests past the recursion limit):
        # the message about the value is still made, not replaced by the repr's error
        return f"{object.__repr__(value)} (its repr failed: {type(e).__name__})"
    if len(text) <= limit:
        return text
    n = len(value) if isinstance(value, str) else len(text)
    return f"{text[:limit]}... ({n:,} characters)"


def shown_key(key: Any, limit: int = MAX_SHOWN_CHARS) -> str:
    """A key (a config key, a dotted key path) as a message names it: its text, bounded as
    shown() bounds a value (a 100 KB key was named whole)."""
    text = str(key)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite_float(v: Any) -> float | None:
    """float(v) for a finite number, else None (an int past float's range, 10**400, raised
    OverflowError out of the check: a batch line's "temperature" stopped the whole scan)."""
    if not _is_number(v):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f if math.isfinite(f) else None


def check_sampling_value(name: str, v: Any) -> Any:
    """Validate and normalise one sampling field; the one set of rules for the engine's
    SamplingParams and the job spec's `sampling` section.

    Returns the normalised value (top_k None -> 0, stop_token_ids and stop lists -> tuples, a
    single stop string -> a 1-tuple, an empty stop list -> None, floats as float; max_tokens
    None stays None: no limit but the context window). Raises
    ValueError("must be ..., got X") for a bad value, KeyError for an unknown name.
    """
    if name == "num_samples":
        if not _is_int(v) or not 1 <= v <= MAX_NUM_SAMPLES:
            raise ValueError(f"must be an integer from 1 to {MAX_NUM_SAMPLES:,}, got {shown(v)}")
    elif name == "max_tokens":
        if v is not None and (not _is_int(v) or v < 1):
            raise ValueError(f"must be an integer >= 1, got {shown(v)}")
    elif name == "temperature":
        f = _finite_float(v)
        if f is None or f < 0:
            raise ValueError(f"must be a finite number >= 0 (0 is greedy), got {shown(v)}")
        return f
    elif name == "top_k":
        v = 0 if v is None else v
        # bounded as the engine's int64 tensor holds it (2**63 failed the whole batch's step)
        if not _is_int(v) or not 0 <= v < 2**63:
            raise ValueError(f"must be an integer >= 0 (0 disables it) and below 2**63, got {shown(v)}")
    elif name == "top_p":
        if not _is_number(v) or not 0.0 < v <= 1.0:
            raise ValueError(f"must be in (0, 1], got {shown(v)}")
        return float(v)
    elif name == "min_p":
        if not _is_number(v) or not 0.0 <= v < 1.0:
            raise ValueError(f"must be in [0, 1), got {shown(v)}")
        return float(v)
    elif name == "seed":
        if not _is_int(v) or not -(2**63) <= v < 2**63:
            raise ValueError(f"must be a 64-bit integer, got {shown(v)}")
    elif name == "stop_token_ids":
        if v is None:
            return None
        if not isinstance(v, (list, tuple)) or any(not _is_int(t) or t < 0 for t in v):
            raise ValueError(f"must be a list of non-negative token ids (or null for the model's default), got {shown(v)}")
        return tuple(v)
    elif name == "stop":
        if v is None:
            return None
        if isinstance(v, str):
            v = (v,)
        if not isinstance(v, (list, tuple)) or any(not isinstance(x, str) or not x for x in v):
            raise ValueError(f"must be a non-empty string or a list of them (or null for none), got {shown(v)}")
        for x in v:  # matched on UTF-8 bytes: a lone surrogate (JSON's "\ud83d") has none, and failed the step
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(f"must be valid Unicode text, got {shown(x)} (a lone surrogate has no UTF-8 "
                                 f"encoding)") from None
        return tuple(v) or None
    elif name == "logprobs_mode":
        if v not in LOGPROBS_MODES:
            raise ValueError(f"must be one of {', '.join(LOGPROBS_MODES)}, got {shown(v)}")
    elif name == "top_logprobs":
        if not _is_int(v) or not 0 <= v <= MAX_TOP_LOGPROBS:
            raise ValueError(f"must be an integer from 0 to {MAX_TOP_LOGPROBS} (0 is off), got {shown(v)}")
    elif name == "calculator":
        if not isinstance(v, bool):
            raise ValueError(f"must be true or false, got {shown(v)}")
    else:
        raise KeyError(name)
    return v


SAMPLING_FIELDS = ("num_samples", "max_tokens", "temperature", "top_k", "top_p", "min_p", "seed",
                   "stop_token_ids", "stop", "logprobs_mode", "top_logprobs", "calculator")
LOGPROBS_MODES = ("raw", "processed")
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs


@dataclass(slots=True)
class ToolCall:
    """One tool call inside a sample: the calculator's (nanochat's tokens) or a Hermes
    <tool_call> (engine/tool_calls.py).

    start: index in Sample.tokens of <|python_start|>, or of the token where "<tool_call>"
        begins.
    end: index one past the last forced token of the result (past <|output_end|>, or past
        the template's rendering of the tool message and the next assistant header); past
        the call itself when nothing was forced (the sample ended first, or the call was not
        run).
    expr: the calculator's decoded expression, or the text between <tool_call> and
        </tool_call>.
    output: the text shown to the model (the result, or "Error: <why>"); None if nothing was
        forced. error: why the call failed (None if it did not).
    name: the tool's name ("calculator" for nanochat's); arguments: the arguments as JSON
        text (None for the calculator, or when they did not parse).
    latency_s: seconds from the call's submission to its tool's return (its wait for a thread
        and its run; for one that timed out, until it was given up: its wait and its timeout;
        0 for one refused before running; None if not run).
    forced_start: index in Sample.tokens of the first forced token of the result (the span
        [forced_start, end) has mask 0 and no logprobs); None if nothing was forced.

    Parallel calls (tools.parallel_calls, engine/tool_turns.py): the calls of one assistant turn
    share one forced block, the tool messages of all of them (in call order) and the next
    assistant header, which begins just after the turn's sampled end-of-turn token (mask 1).
    Each call of the turn has its own start, and forced_start and end of that whole block, so
    [forced_start, end) is the same span for all of them and [start, end) of an earlier call
    holds the later calls' text. A call not run (its turn never ended, or was past max_turns)
    has end one past its </tool_call> token and no forced_start; a call answered before the
    sample was aborted, while others of its turn ran, has its output and no forced_start.
    """

    start: int
    end: int
    expr: str
    output: str | None
    error: str | None
    name: str | None = None
    arguments: str | None = None
    latency_s: float | None = None
    forced_start: int | None = None


@dataclass(slots=True)
class Sample:
    """One continuation of one prompt.

    tokens: generated token ids, forced tool-output tokens included, and the stop token that
        ended the sample (if one did) as the last token. mask: one per token, 1 sampled by the
        model (the stop token included), 0 forced (tool output).
    logprobs: one per token, in nats, None for forced tokens. SamplingParams.logprobs_mode
        "raw": log_softmax(raw logits)[token], from the model's unscaled fp32 logits
        (temperature 1, no top-k/top-p/min-p truncation), i.e. what a trainer recomputes from
        the same weights; "processed": the log-probability of the token under the distribution
        the sampler drew it from (0 for greedy).
    finish_reason: "stop" (a stop token was sampled, or a stop string completed), "length"
        (max_tokens or the context window), "error" (see `error`) or "abort" (Engine.abort
        ended it: its tokens are those generated so far, none if it never started).
    stop_reason: what ended a "stop" sample, as vLLM reports it: the stop token id (int, also
        tokens[-1]) or the stop string (str); None otherwise.
    weight_versions: one per token, the engine's `weight_version` when the token was sampled
        or forced (0: the weights loaded at start, +1 per swap). A sample paused and
        continued across a weights swap (Engine.continue_request) carries both versions.
    top_logprob_ids, top_logprobs: None unless SamplingParams.top_logprobs k > 0; then one
        list per token: the (at most) k most likely tokens at that position, most likely
        first (equal logprobs: lower id first), and their logprobs under the distribution
        `logprobs` uses (so a sampled token in the list has its `logprobs` value there).
        "processed" lists only tokens the sampler could draw (fewer than k when fewer
        survive top_k/top_p/min_p; greedy: the argmax alone, at 0). None for forced tokens.
    """

    prompt_id: str
    sample_index: int
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str = "length"
    tool_calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None
    num_prompt_tokens: int = 0
    seed: int = 0
    stop_reason: int | str | None = None
    weight_versions: list[int] = field(default_factory=list)
    top_logprob_ids: list[list[int] | None] | None = None
    top_logprobs: list[list[float] | None] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request: all `num_samples` samples of one prompt, in sample_index order."""

    request_id: Any
    prompt_id: str
    prompt_tokens: list[int]
    samples: list[Sample]


def error_output(request_id: Any, prompt_id: str, prompt_tokens: list[int] | None, params: SamplingParams,
                 message: str) -> RequestOutput:
    """A request that failed as a whole: `num_samples` samples with finish_reason "error".

    Every sample is kept (one error row per sample), so nothing goes missing downstream.
    """
    toks = list(prompt_tokens or [])
    samples = [Sample(prompt_id=prompt_id, sample_index=j, finish_reason="error", error=message,
                      num_prompt_tokens=len(toks), seed=params.seed) for j in range(params.num_samples)]
    return RequestOutput(request_id=request_id, prompt_id=prompt_id, prompt_tokens=toks, samples=samples)


def aborted_output(request_id: Any, prompt_id: str, prompt_tokens: list[int] | None,
                   params: SamplingParams) -> RequestOutput:
    """A request aborted before any of its samples started: `num_samples` samples with no
    tokens and finish_reason "abort" (Engine.abort; a worker's aborted units)."""
    toks = list(prompt_tokens or [])
    samples = [Sample(prompt_id=prompt_id, sample_index=j, finish_reason="abort", num_prompt_tokens=len(toks),
                      seed=params.seed) for j in range(params.num_samples)]
    return RequestOutput(request_id=request_id, prompt_id=prompt_id, prompt_tokens=toks, samples=samples)
