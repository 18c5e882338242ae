"""Where a hidden test can be copied into a mutation sentinel, and what its copies expect.

A mutation sentinel is a real test with one literal on the expected side of one of its
equality assertions changed (reward.grading.sentinels plants them). The literal is one the
function surely reaches and compares: a constant leaf of the constant side of an
`assert <expr> == <constant expr>` (either order) or `self.assertEqual(...)`-style call
that is a direct statement of the test's body, in a test with no `return`, `yield` or
`await`. Both sides are left as written but for that leaf, so the copy makes the same
calls into the code under test, in the same order, with the same fixtures.

Why a copy and its original never both pass honestly: they make the same calls and
expect `e` and `e2`, values of the same builtin type that the host evaluated to differ
(every copy of a group a different one); a value `v` that compares by value (numbers,
strings, bytes and containers of them) cannot equal two of them, and `x` / `not x` (or
assertTrue / assertFalse) cannot both hold. So the copy fails on a correct implementation
(which passes the original), a wrong one may pass one member of a group but never two,
and two members passing is tampering (reward.grading.crosscheck). The calls must be
deterministic, as the test itself must be. What this does not cover: a reference
solution whose result's own `__eq__` accepts both values (pytest.approx-like results),
and tests that fail when run twice in one process (a copy may run before its original);
such a row fails its gold check (`python -m reward.validate`), which is how it is found.

Indistinguishability: the changed literal is written in the original's style (same quote,
decimal digits, same number of decimals) and the k values a group of copies uses form a
symmetric set around nothing in particular: a run of consecutive integers (or numbers a
decimal step apart), or one character position that takes k+1 characters of one class,
with the true value at a uniformly random place among them. So neither the copies'
source nor their values single out the original; see reward.grading.sentinels for names
and places.
"""

from __future__ import annotations

import ast
import random
import string
from dataclasses import dataclass

# unittest's equality assertions (the first two arguments are compared with ==).
EQ_ASSERTS = frozenset({"assertEqual", "assertEquals", "assertListEqual", "assertTupleEqual",
                        "assertDictEqual", "assertSetEqual", "assertSequenceEqual",
                        "assertMultiLineEqual", "failUnlessEqual"})
MAX_COPIES_PER_SITE = 4
MAX_VALUE_LEN = 100_000  # constant expressions the host evaluates stay small
# Punctuation a changed character may take: no quote or backslash (the literal's text
# then needs no escaping), no whitespace (trailing spaces would stand out).
PUNCTUATION = ".,;:-_/!?+*=<>()[]{}#@%&|~^"
CHAR_CLASSES = (string.ascii_lowercase, string.ascii_uppercase, string.digits, PUNCTUATION)
_SAFE_TYPES = (int, float, str, bytes, bool, tuple, list, dict, set, frozenset)


class NotConstant(Exception):
    """An expression the host does not evaluate (it names, calls or is too large)."""


# unittest assertions and their opposites: exactly one of each pair holds for a value.
OPPOSITE_ASSERTS = {"assertTrue": "assertFalse", "assertIsNone": "assertIsNotNone",
                    "assertIn": "assertNotIn", "assertIs": "assertIsNot",
                    "assertIsInstance": "assertNotIsInstance"}
OPPOSITE_ASSERTS.update({v: k for k, v in list(OPPOSITE_ASSERTS.items())})
# Expressions `not` can be put before (or taken from) without parentheses changing.
_NEGATABLE = (ast.Call, ast.Name, ast.Attribute, ast.Subscript)


@dataclass(frozen=True, slots=True)
class Site:
    """A piece of a test's assertion that can be changed: its place in the file (1-based
    line, UTF-8 byte columns) and source text; a literal (with its value and the constant
    expression it belongs to) or a polarity (`assert x` / `assert not x`,
    `assertTrue` / `assertFalse`, ...: `opposite` is the other text)."""

    line: int
    start: int
    end: int
    value: int | float | str | bytes | None
    text: str
    expected: ast.expr | None = None  # the whole constant side of the assertion
    leaf: ast.Constant | None = None
    opposite: str | None = None  # set for a polarity

    def capacity(self) -> int:
        """How many copies can expect distinct values of this site."""
        if self.opposite is not None or isinstance(self.value, bool):
            return 1
        return MAX_COPIES_PER_SITE


def mutation_sites(node: ast.FunctionDef, lines: list[str]) -> list[Site]:
    """Every literal of `node` (a test function of the file whose lines are `lines`) that a
    copy may change; [] where the test has none or may leave before its last line."""
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Return, ast.Yield, ast.YieldFrom, ast.Await, ast.Lambda,
                            ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
                and sub is not node:
            return []
    sites = []
    for statement in node.body:
        polarity = _polarity_site(statement, lines)
        if polarity is not None:
            sites.append(polarity)
        expected = _expected_side(statement)
        if expected is None:
            continue
        for leaf in ast.walk(expected):
            if isinstance(leaf, ast.Constant):
                site = _site(leaf, expected, lines)
                if site is not None:
                    sites.append(site)
    return sites


def _polarity_site(statement: ast.stmt, lines: list[str]) -> Site | None:
    """`assert x` <-> `assert not x` (x a call, name, attribute or subscript that is not a
    constant) and unittest's opposite assertions: on a correct implementation the
    original holds, so the opposite does not."""
    if isinstance(statement, ast.Assert):
        test = statement.test
        inner = test.operand if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not) \
            else test
        if not isinstance(inner, _NEGATABLE) or _is_constant(inner) \
                or test.lineno != test.end_lineno:
            return None
        text = _span_text(lines, test.lineno, test.col_offset, test.end_col_offset)
        inner_text = _span_text(lines, inner.lineno, inner.col_offset, inner.end_col_offset)
        opposite = inner_text if inner is not test else f"not {text}"
        return Site(test.lineno, test.col_offset, test.end_col_offset or 0, None, text,
                    opposite=opposite)
    if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) \
            and isinstance(statement.value.func, ast.Attribute) \
            and statement.value.func.attr in OPPOSITE_ASSERTS \
            and isinstance(statement.value.func.value, ast.Name) \
            and statement.value.func.value.id == "self":
        func = statement.value.func
        if func.end_lineno != func.lineno or func.end_col_offset is None:
            return None
        start = func.end_col_offset - len(func.attr.encode())
        return Site(func.lineno, start, func.end_col_offset, None, func.attr,
                    opposite=OPPOSITE_ASSERTS[func.attr])
    return None


def _span_text(lines: list[str], line: int, start: int, end: int | None) -> str:
    return lines[line - 1].encode("utf-8")[start:end].decode("utf-8", "replace")


def _expected_side(statement: ast.stmt) -> ast.expr | None:
    """The constant side of an equality assertion that is a direct statement of a test,
    when exactly one side is constant."""
    if isinstance(statement, ast.Assert) and isinstance(statement.test, ast.Compare) \
            and len(statement.test.ops) == 1 and isinstance(statement.test.ops[0], ast.Eq):
        sides = [statement.test.left, statement.test.comparators[0]]
    elif isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call) \
            and isinstance(statement.value.func, ast.Attribute) \
            and statement.value.func.attr in EQ_ASSERTS \
            and isinstance(statement.value.func.value, ast.Name) \
            and statement.value.func.value.id == "self" and len(statement.value.args) >= 2 \
            and not statement.value.keywords:
        sides = list(statement.value.args[:2])
    else:
        return None
    constant = [s for s in sides if _is_constant(s)]
    return constant[0] if len(constant) == 1 else None


def _is_constant(node: ast.expr) -> bool:
    try:
        value = evaluate(node)
    except NotConstant:
        return False
    return isinstance(value, _SAFE_TYPES) and value == value  # NaN never equals


def evaluate(node: ast.expr, replace: ast.Constant | None = None, by: object = None) -> object:
    """The value of a constant expression (literals, containers, unary signs, +, -, *),
    with the literal `replace` read as `by`; NotConstant for anything else."""
    if isinstance(node, ast.Constant):
        value = by if node is replace else node.value
        if value is None or value is Ellipsis or isinstance(value, complex):
            raise NotConstant
        return value
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [evaluate(e, replace, by) for e in node.elts]
        return tuple(items) if isinstance(node, ast.Tuple) else items
    try:
        if isinstance(node, ast.Set):
            return {evaluate(e, replace, by) for e in node.elts}
        if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
            return {evaluate(k, replace, by): evaluate(v, replace, by)  # type: ignore[arg-type]
                    for k, v in zip(node.keys, node.values)}
    except TypeError:  # an unhashable member: the test itself would raise
        raise NotConstant from None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = evaluate(node.operand, replace, by)
        if not isinstance(operand, (int, float)):
            raise NotConstant
        return -operand if isinstance(node.op, ast.USub) else +operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult)):
        return _binop(node.op, evaluate(node.left, replace, by), evaluate(node.right, replace, by))
    raise NotConstant


def _binop(op: ast.operator, left: object, right: object) -> object:
    sized = [v for v in (left, right) if isinstance(v, (str, bytes, list, tuple))]
    counts = [v for v in (left, right) if isinstance(v, int)]
    if isinstance(op, ast.Mult) and sized and counts and \
            len(sized[0]) * abs(counts[0]) > MAX_VALUE_LEN:
        raise NotConstant
    try:
        if isinstance(op, ast.Add):
            return left + right  # type: ignore[operator]
        if isinstance(op, ast.Sub):
            return left - right  # type: ignore[operator]
        return left * right  # type: ignore[operator]
    except TypeError:
        raise NotConstant from None


def _site(leaf: ast.Constant, expected: ast.expr, lines: list[str]) -> Site | None:
    if leaf.end_lineno != leaf.lineno or leaf.end_col_offset is None:
        return None
    raw = lines[leaf.lineno - 1].encode("utf-8")
    text = raw[leaf.col_offset:leaf.end_col_offset].decode("utf-8", "replace")
    value = leaf.value
    if not isinstance(value, (int, float, str, bytes)):
        return None  # None, Ellipsis and complex literals are never changed
    if isinstance(value, bool):
        ok = text in ("True", "False")
    elif isinstance(value, int):
        ok = text == str(value)
    elif isinstance(value, float):
        ok = text == repr(value) and "e" not in text and "n" not in text
    elif isinstance(value, str):
        ok = _plain_string(text, value, "") and any(_class_of(c) for c in value)
    else:  # bytes
        ok = value.isascii() and _plain_string(text, value.decode("ascii"), "b") and \
            any(_class_of(chr(c)) for c in value)
    if not ok:
        return None
    return Site(leaf.lineno, leaf.col_offset, leaf.end_col_offset, value, text, expected, leaf)


def _plain_string(text: str, value: str, prefix: str) -> bool:
    """A one-line literal written as prefix + quote + value + quote (no escapes)."""
    if len(text) < len(prefix) + 2 or not text.startswith(prefix):
        return False
    quote = text[len(prefix)]
    return quote in "'\"" and text == f"{prefix}{quote}{value}{quote}" and "\\" not in value \
        and quote not in value


def _class_of(char: str) -> str:
    return next((c for c in CHAR_CLASSES if char in c), "")


def variants(site: Site, k: int, rng: random.Random) -> tuple[list[str], int] | None:
    """k + 1 literal texts for the site, the original's among them at index `at` (uniform),
    as (texts, at); None when k distinct changed values that surely change the expected
    value cannot be made."""
    value = site.value
    if site.opposite is not None:
        if k != 1:
            return None
        texts = [site.text, site.opposite]
        rng.shuffle(texts)
        return texts, texts.index(site.text)
    if isinstance(value, bool):
        if k != 1:
            return None
        values: list[object] = [value, not value]
        rng.shuffle(values)
        texts = [repr(v) for v in values]
    elif isinstance(value, int):
        start = value - rng.randrange(min(k, value) + 1 if value >= 0 else k + 1)
        texts = [str(v) for v in range(start, start + k + 1)]
    elif isinstance(value, float):
        texts = _float_window(site.text, value, k, rng)
    else:
        texts = _char_variants(site, k, rng)
    if texts is None or site.text not in texts or len(set(texts)) != k + 1:
        return None
    if not _changes_the_expected_value(site, texts):
        return None
    return texts, texts.index(site.text)


def _float_window(text: str, value: float, k: int, rng: random.Random) -> list[str] | None:
    """k + 1 numbers a decimal step apart (the step of the literal's last decimal), none
    negative where the literal is not."""
    decimals = 0 if value.is_integer() else len(text.split(".", 1)[1])
    step = 10.0 ** -decimals
    units = round(value / step)
    first = units - rng.randrange(min(k, units) + 1)
    texts = [repr(round((first + j) * step, decimals)) if decimals else repr(float(first + j))
             for j in range(k + 1)]
    return texts if all("e" not in t for t in texts) else None


def _char_variants(site: Site, k: int, rng: random.Random) -> list[str] | None:
    prefix = "b" if isinstance(site.value, bytes) else ""
    quote = site.text[len(prefix)]
    body = site.text[len(prefix) + 1:-1]
    positions = [i for i, c in enumerate(body) if _class_of(c)]
    if not positions:
        return None
    at = rng.choice(positions)
    pool = [c for c in _class_of(body[at]) if c != body[at] and c != quote]
    if len(pool) < k:
        return None
    chars = [*rng.sample(pool, k), body[at]]
    rng.shuffle(chars)
    return [f"{prefix}{quote}{body[:at]}{c}{body[at + 1:]}{quote}" for c in chars]


def _changes_the_expected_value(site: Site, texts: list[str]) -> bool:
    """Every text gives the whole expected expression a value of the original's type that
    differs from the original's and from every other's."""
    assert site.expected is not None and site.leaf is not None
    original = evaluate(site.expected)
    seen = []
    for text in texts:
        value = evaluate(site.expected, site.leaf, ast.literal_eval(text))
        if type(value) is not type(original) or any(value == s for s in seen):
            return False
        if text != site.text and value == original:
            return False
        seen.append(value)
    return True


def replace_literal(line: str, site: Site, text: str) -> str:
    """`line` (the site's line) with the literal written as `text`."""
    raw = line.encode("utf-8")
    return (raw[:site.start] + text.encode("utf-8") + raw[site.end:]).decode("utf-8")
