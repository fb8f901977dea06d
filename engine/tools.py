"""The calculator tool: a safe, bounded evaluator for the model's <|python_start|> spans.

The engine decodes the tokens between <|python_start|> and <|python_end|>, calls
``calculator(text)``, and when ``.output`` is not None forces
``<|output_start|> output <|output_end|>`` into the sequence (as nanochat's engine does with
its ``use_calculator``). nanochat evaluates the text with ``eval`` under a SIGALRM timeout;
this module uses neither: no eval/exec/compile of code, no signals, so it is safe to call
from any thread (a Ray actor, a worker thread) and is deterministic.

Pipeline (every stage bounded; ``calculator`` never raises and never allocates more than
O(MAX_EXPR_CHARS) memory):

1. type and length check on the raw text (``MAX_EXPR_CHARS``), before any other work;
2. remove commas (thousands separators: "1,000" -> "1000"; as nanochat does, this also
   removes commas inside string literals), strip surrounding whitespace;
3. character whitelist ``ALLOWED_CHARS`` (printable ASCII minus backslash and a few
   symbols): rejects unicode look-alikes (fullwidth / Arabic-Indic digits, U+2212 minus,
   '×', '÷'), null bytes, lone surrogates, backslash escapes, with an error naming the
   character. No normalisation (NFKC) is attempted: look-alikes are rejected, not guessed;
4. a cheap lexical pre-scan: string literals, numbers, names, operators; rejects
   unterminated strings, numeric literals longer than ``MAX_LITERAL_CHARS`` (before any
   int conversion: CPython 3.11 raises ValueError past 4300 digits), a number glued to a
   letter ("1or 2", "0x1f", "1j": would otherwise make ast.parse emit SyntaxWarnings),
   and parenthesis nesting deeper than ``MAX_DEPTH``;
5. ``ast.parse(text, mode="eval")``, then an iterative walk that rejects trees with more
   than ``MAX_AST_NODES`` nodes or deeper than ``MAX_DEPTH`` (so the recursive evaluator
   cannot hit RecursionError);
6. evaluation by walking a whitelist of node types:

   * int and float literals (decimal; ``1_000`` and ``1e3`` as Python spells them),
     with ``|x| < MAX_MAGNITUDE``;
   * binary ``+ - * / // %``; unary ``-`` and ``+``; parentheses;
   * ``'literal'.count('literal')``: a str constant's ``.count`` with exactly one str
     constant argument, no keywords (either quote style). Its result is bounded by the
     literal's length, itself bounded by ``MAX_EXPR_CHARS``.

   Everything else is rejected with an error saying what is not allowed: names, calls,
   other attributes, ``**``, bit operators, subscripts, comparisons, boolean operators,
   comprehensions, lambdas, walrus, f-strings, bytes, complex numbers, True/False/None,
   Ellipsis, string arithmetic (``'a'*3``), etc. After EVERY operation the result is
   checked: ints and floats must satisfy ``|x| < MAX_MAGNITUDE`` and floats must be
   finite, so a chain of multiplications cannot grow past the bound. The wall clock
   (``time.perf_counter``) is checked at every node against ``TIME_BUDGET_S`` (see there for
   why an over-budget wall clock must be confirmed by this thread's own CPU time);
7. the output is ``str(result)`` -- exactly what nanochat's ``str(eval(expr))`` prints for the
   same allowed expression (ints as ints, true division as floats: "2.5", "4.0",
   "0.30000000000000004", "1e+16") -- and is at most ``MAX_OUTPUT_CHARS`` long.

Differences from nanochat's use_calculator (deliberate):
  * ``%`` (modulo) is accepted (nanochat's pure-math whitelist lacks it), with Python's
    semantics;
  * numbers written ``1_000`` or ``1e3`` are accepted;
  * huge results, non-finite floats and deep nesting are errors (nanochat would print e.g.
    a 1,000-digit integer or "inf", or hang until the alarm);
  * division by zero (``/``, ``//``, ``%``) gives error "division by zero";
  * tabs and line breaks count as spaces (nanochat's whitelists hold only ' ');
  * a ``.count`` result is a number like any other (``'abc'.count('a') + 1`` is 2; nanochat's
    string whitelist has no operators, so it gives no result);
  * the literals are only counted in, never run, so nanochat's blocklist of substrings
    ('__', 'import', 'open', 'file', 'dir', 'input', 'eval', 'vars', ... anywhere in the
    text, even inside a quoted word) does not apply: ``'profile'.count('f')`` is 1 here, no
    result in nanochat;
  * a method between the literal and ``.count`` (``'Hi'.lower().count('h')``, which nanochat
    evaluates) and an empty tuple ``()`` (nanochat prints "()") are errors.
  Where nanochat gives no result, nanochat's engine forces nothing; batchgen forces
  "Error: <why>" (engine/sequence.py).

GSM8K (train split) annotations ``<<expr=result>>`` use only the characters
``0123456789+-*/(). `` -- no '$', '%', 'x' or '^' -- so none of those is supported as
GSM8K's text means it: '$' and 'x' are rejected by the whitelist and '^' too (it would be XOR
in Python, not power); '%' is Python's modulo (above), never a percentage.
See bench/gsm8k_calculator.py and tests/test_tools.py for the measured agreement.
"""
from __future__ import annotations

import ast
import math
import re
import string
import time
from dataclasses import dataclass

__all__ = [
    "ToolResult",
    "calculator",
    "MAX_EXPR_CHARS",
    "MAX_LITERAL_CHARS",
    "MAX_DEPTH",
    "MAX_AST_NODES",
    "MAX_MAGNITUDE",
    "MAX_OUTPUT_CHARS",
    "TIME_BUDGET_S",
    "TIME_BUDGET_CPU_S",
    "ALLOWED_CHARS",
]

# ---------------------------------------------------------------------------------------
# Limits

#: Longest accepted input, in characters, checked on the raw text before anything else.
#: GSM8K's longest train annotation expression is well under 200 characters.
MAX_EXPR_CHARS = 1_000

#: Longest numeric literal (digits, '.', '_', exponent), checked lexically before the text is
#: parsed, so no literal is ever converted that could exceed MAX_MAGNITUDE by a lot or hit
#: CPython's 4300-digit int-from-string limit.
MAX_LITERAL_CHARS = 120

#: Deepest nesting accepted: parentheses in the pre-scan, and AST depth (number of nested
#: expression nodes: unary chains and long left-nested sums count too) after parsing.
#: Keeps the recursive evaluator far from Python's recursion limit.
MAX_DEPTH = 100

#: Most AST nodes (operators and contexts included) in one expression.
MAX_AST_NODES = 1_000

#: Every literal and every intermediate / final result x must satisfy |x| < MAX_MAGNITUDE
#: (ints and floats alike; floats must also be finite). With it, ints have <= 100 digits.
MAX_MAGNITUDE = 10**100

#: Longest output text. str() of any value within MAX_MAGNITUDE is <= 101 characters
#: ('-' and 100 digits); the check is a second line of defence.
MAX_OUTPUT_CHARS = 128

#: Wall-clock budget for one call, checked (time.perf_counter) at every evaluated node.
#: The limits above already make a call take well under a millisecond (GSM8K: ~20 us); this
#: bounds the unexpected. A call is stopped once the wall clock is past the budget AND this
#: thread has itself spent more than TIME_BUDGET_CPU_S of CPU time (time.thread_time) in it:
#: on a loaded machine a thread can be descheduled for tens of ms (measured: a 20 ms stall
#: on a trivial expression at load average 6 on 2 cores), and a stall must not turn a
#: correct answer into an error -- that would make generation depend on machine load.
#: Runaway work burns CPU and is stopped; a mere stall is not. The test suite asserts
#: every call returns within 100 ms.
TIME_BUDGET_S = 0.050
TIME_BUDGET_CPU_S = 0.025

#: Characters accepted (after comma removal): ASCII letters and digits, ASCII whitespace and
#: + - * / % ( ) . _ ' " -- nothing else (no backslash: escapes could spell non-ASCII text;
#: no '$', 'x'-as-times or '^': GSM8K's annotations never use them).
ALLOWED_CHARS = frozenset(
    string.ascii_letters + string.digits + " \t\n\r" + "+-*/%()._'\""
)

# ---------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class ToolResult:
    """Outcome of one tool call.

    output: the text to force between <|output_start|> and <|output_end|>; None on failure.
    error:  why it failed; None on success.
    """

    output: str | None
    error: str | None


class _Reject(Exception):
    """Raised internally with a user-facing message; never escapes calculator()."""


# One lexical token at a time; tried in order at the current position. No pattern can
# backtrack more than linearly (the input is at most MAX_EXPR_CHARS long anyway).
_TOKEN = re.compile(
    r"""
    (?P<ws>[ \t\n\r]+)
  | (?P<str>'[^']*'|"[^"]*")
  | (?P<num>(?:\d[\d_]*(?:\.[\d_]*)?|\.\d[\d_]*)(?:[eE][+-]?\d[\d_]*)?)
  | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
  | (?P<op>[-+*/%().])
    """,
    re.VERBOSE,
)

_BINOPS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
}

_OP_NAMES = {
    ast.Pow: "** (power)",
    ast.LShift: "<<",
    ast.RShift: ">>",
    ast.BitOr: "|",
    ast.BitXor: "^",
    ast.BitAnd: "&",
    ast.MatMult: "@",
    ast.Invert: "~",
    ast.Not: "not",
}


def calculator(expr: str) -> ToolResult:
    """Evaluate a calculator expression safely; see the module docstring for the grammar.

    Never raises; returns ToolResult(output=str(value), error=None) or
    ToolResult(output=None, error=message).
    """
    budget = (time.perf_counter() + TIME_BUDGET_S, time.thread_time() + TIME_BUDGET_CPU_S)
    try:
        value = _evaluate_text(expr, budget)
        out = str(value)
        if len(out) > MAX_OUTPUT_CHARS:
            return ToolResult(None, f"output longer than {MAX_OUTPUT_CHARS} characters")
        return ToolResult(out, None)
    except _Reject as e:
        return ToolResult(None, str(e))
    except ZeroDivisionError:
        return ToolResult(None, "division by zero")
    except RecursionError:
        return ToolResult(None, "expression too deeply nested")
    except MemoryError:
        return ToolResult(None, "out of memory")
    except Exception as e:  # noqa: BLE001 - the tool must never raise into the engine
        return ToolResult(None, f"could not evaluate: {type(e).__name__}")


# ---------------------------------------------------------------------------------------
# Stages


def _evaluate_text(expr, budget: tuple[float, float]) -> int | float:
    if not isinstance(expr, str):
        raise _Reject(f"expression must be a str, not {type(expr).__name__}")
    if len(expr) > MAX_EXPR_CHARS:
        raise _Reject(f"expression longer than {MAX_EXPR_CHARS} characters")
    text = expr.replace(",", "").strip()
    if not text:
        raise _Reject("empty expression")
    for ch in text:
        if ch not in ALLOWED_CHARS:
            raise _Reject(f"character {ch!r} (U+{ord(ch):04X}) is not allowed")
    _prescan(text)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise _Reject(f"syntax error: {e.msg}") from None
    except (ValueError, OverflowError) as e:  # e.g. a literal past an interpreter limit
        raise _Reject(f"syntax error: {type(e).__name__}") from None
    _check_shape(tree.body)
    return _eval(tree.body, budget)


def _prescan(text: str) -> None:
    """Cheap lexical checks that protect ast.parse and int conversion (see module doc)."""
    pos, n, depth, prev = 0, len(text), 0, None
    while pos < n:
        m = _TOKEN.match(text, pos)
        if m is None:
            ch = text[pos]
            if ch in "'\"":
                raise _Reject("unterminated string literal")
            raise _Reject(f"unexpected character {ch!r}")
        kind, tok = m.lastgroup, m.group()
        if kind == "num":
            if len(tok) > MAX_LITERAL_CHARS:
                raise _Reject(f"number literal longer than {MAX_LITERAL_CHARS} characters")
        elif kind == "name":
            if prev == "num":
                raise _Reject(f"number immediately followed by {tok!r} is not allowed")
        elif kind == "op":
            if tok == "(":
                depth += 1
                if depth > MAX_DEPTH:
                    raise _Reject(f"parentheses nested deeper than {MAX_DEPTH}")
            elif tok == ")":
                depth -= 1
        prev = kind  # whitespace resets: only a letter glued to a number is rejected here
        pos = m.end()


def _check_shape(root: ast.AST) -> None:
    """Iteratively bound the node count and depth (no recursion on untrusted depth)."""
    count = 0
    stack = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_AST_NODES:
            raise _Reject(f"expression has more than {MAX_AST_NODES} nodes")
        if depth > MAX_DEPTH:
            raise _Reject(f"expression nested deeper than {MAX_DEPTH}")
        for child in ast.iter_child_nodes(node):
            stack.append((child, depth + 1))


def _bounded(value, what: str):
    """Check a literal or an operation's result against the magnitude bounds."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _Reject(f"{what} is not finite")
    if abs(value) >= MAX_MAGNITUDE:
        raise _Reject(f"{what} too large (|x| must be < 1e100)")
    return value


def _eval(node: ast.AST, budget: tuple[float, float]):
    if time.perf_counter() > budget[0] and time.thread_time() > budget[1]:
        raise _Reject(f"time budget of {TIME_BUDGET_S * 1000:.0f} ms exceeded")

    if isinstance(node, ast.Constant):
        v = node.value
        # bool is a subclass of int: check it first.
        if isinstance(v, bool) or v is None or v is Ellipsis:
            raise _Reject(f"literal {v!r} is not allowed")
        if type(v) is int or type(v) is float:
            return _bounded(v, "number")
        if isinstance(v, str):
            raise _Reject("a string is only allowed as 'text'.count('text')")
        raise _Reject(f"{type(v).__name__} literals are not allowed")

    if isinstance(node, ast.BinOp):
        op = _BINOPS.get(type(node.op))
        if op is None:
            raise _Reject(f"operator {_OP_NAMES.get(type(node.op), type(node.op).__name__)} is not allowed")
        left = _eval(node.left, budget)
        right = _eval(node.right, budget)
        if op == "+":
            r = left + right
        elif op == "-":
            r = left - right
        elif op == "*":
            r = left * right
        elif op == "/":
            r = left / right
        elif op == "//":
            r = left // right
        else:
            r = left % right
        return _bounded(r, "result")

    if isinstance(node, ast.UnaryOp):
        if isinstance(node.op, ast.USub):
            return -_eval(node.operand, budget)
        if isinstance(node.op, ast.UAdd):
            return +_eval(node.operand, budget)
        raise _Reject(f"operator {_OP_NAMES.get(type(node.op), type(node.op).__name__)} is not allowed")

    if isinstance(node, ast.Call):
        return _eval_count(node)

    if isinstance(node, ast.Attribute):
        raise _Reject(f"attribute {node.attr!r} is not allowed (only 'text'.count('text'))")
    if isinstance(node, ast.Name):
        raise _Reject(f"name {node.id!r} is not allowed")
    raise _Reject(f"{type(node).__name__} expressions are not allowed")


def _eval_count(node: ast.Call) -> int:
    func = node.func
    if not (
        isinstance(func, ast.Attribute)
        and func.attr == "count"
        and isinstance(func.value, ast.Constant)
        and type(func.value.value) is str
    ):
        if isinstance(func, ast.Name):
            raise _Reject(f"calling {func.id!r} is not allowed (only 'text'.count('text'))")
        raise _Reject("function calls are not allowed (only 'text'.count('text'))")
    if node.keywords or len(node.args) != 1:
        raise _Reject(".count takes exactly one string argument here")
    arg = node.args[0]
    if not (isinstance(arg, ast.Constant) and type(arg.value) is str):
        raise _Reject(".count takes exactly one string argument here")
    haystack, needle = func.value.value, arg.value
    # Both literals come from the (length-bounded) source text, so this is O(MAX_EXPR_CHARS).
    if len(haystack) > MAX_EXPR_CHARS or len(needle) > MAX_EXPR_CHARS:
        raise _Reject("string literal too long")
    return haystack.count(needle)
