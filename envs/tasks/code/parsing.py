"""Bundled code tasks about parsing text (see envs.tasks.code for the format)."""

from envs.tasks.code import CodeTaskSpec

PARSE_DURATION = CodeTaskSpec(
    name="parse_duration",
    module="duration.py",
    prompt="""Implement `parse_duration(text: str) -> int`, the number of seconds in a duration
such as "1h30m15s" (5415). Units: d (86400 s), h, m, s. Each part is a non-negative
integer followed by its unit; units appear at most once and in the order d, h, m, s, and
at least one part is present ("90s" and "2d5m" are valid). Anything else raises
ValueError: "", "h", "5", "1h1h", "5m1h", "1.5h", "5x", " 5s", "-5s".""",
    stub='''def parse_duration(text: str) -> int:
    """Seconds in a duration like "1h30m15s"."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from duration import parse_duration


class TestParseDuration(unittest.TestCase):
    def test_full(self):
        self.assertEqual(parse_duration("1h30m15s"), 5415)

    def test_seconds_only(self):
        self.assertEqual(parse_duration("90s"), 90)
''',
    hidden_tests='''import pytest

from duration import parse_duration


def test_days_and_minutes():
    assert parse_duration("2d5m") == 2 * 86400 + 300


def test_zero_parts():
    assert parse_duration("0s") == 0
    assert parse_duration("0h0m") == 0


def test_big_numbers():
    assert parse_duration("100m") == 6000


def test_rejects():
    for bad in ["", "h", "5", "1h1h", "5m1h", "1.5h", "5x", " 5s", "-5s", "5s "]:
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_all_units():
    assert parse_duration("1d1h1m1s") == 90061
''',
    reference='''import re

_PATTERN = re.compile(r"(?:(\\d+)d)?(?:(\\d+)h)?(?:(\\d+)m)?(?:(\\d+)s)?")
_UNITS = (86400, 3600, 60, 1)


def parse_duration(text: str) -> int:
    match = _PATTERN.fullmatch(text)
    if not text or match is None:
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(v) * unit for v, unit in zip(match.groups(), _UNITS) if v is not None)
''',
)

SPLIT_CSV = CodeTaskSpec(
    name="split_csv_line",
    module="csvline.py",
    prompt="""Implement `split_csv_line(line: str) -> list[str]`, splitting one CSV line on
commas. A field may be enclosed in double quotes; inside quotes commas are kept and a
doubled quote ("") stands for one quote character. Unquoted fields are taken as is
(spaces kept). Examples: 'a,b' -> ["a", "b"]; '"x,y",z' -> ["x,y", "z"];
'"a ""b"" c"' -> ['a "b" c']; "" -> [""]; "a," -> ["a", ""]. An unterminated quoted
field, or text after a closing quote other than a comma ('"a"b'), raises ValueError.
Do not use the csv module.""",
    stub='''def split_csv_line(line: str) -> list[str]:
    """Fields of one CSV line (double-quote quoting)."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from csvline import split_csv_line


class TestSplitCsvLine(unittest.TestCase):
    def test_plain(self):
        self.assertEqual(split_csv_line("a,b"), ["a", "b"])

    def test_quoted_comma(self):
        self.assertEqual(split_csv_line('"x,y",z'), ["x,y", "z"])
''',
    hidden_tests='''import pytest

from csvline import split_csv_line


def test_escaped_quotes():
    assert split_csv_line('"say ""hi"""') == ['say "hi"']


def test_empty_fields():
    assert split_csv_line("") == [""]
    assert split_csv_line("a,") == ["a", ""]
    assert split_csv_line(",,") == ["", "", ""]


def test_spaces_kept():
    assert split_csv_line(" a , b") == [" a ", " b"]


def test_unterminated():
    with pytest.raises(ValueError):
        split_csv_line('"abc')


def test_text_after_quote():
    with pytest.raises(ValueError):
        split_csv_line('"a"b')


def test_empty_quoted():
    assert split_csv_line('"",x') == ["", "x"]
''',
    reference='''def split_csv_line(line: str) -> list[str]:
    fields = []
    i, n = 0, len(line)
    while True:
        if i < n and line[i] == '"':
            i += 1
            value = []
            while True:
                if i >= n:
                    raise ValueError("unterminated quoted field")
                if line[i] == '"':
                    if i + 1 < n and line[i + 1] == '"':
                        value.append('"')
                        i += 2
                        continue
                    i += 1
                    break
                value.append(line[i])
                i += 1
            fields.append("".join(value))
            if i < n and line[i] != ",":
                raise ValueError("text after a closing quote")
        else:
            j = line.find(",", i)
            j = n if j < 0 else j
            fields.append(line[i:j])
            i = j
        if i >= n:
            return fields
        i += 1  # the comma
''',
)

PARSE_QUERY = CodeTaskSpec(
    name="parse_query",
    module="query.py",
    prompt="""Implement `parse_query(query: str) -> dict[str, list[str]]`, parsing a URL query
string: "a=1&b=2&a=3" -> {"a": ["1", "3"], "b": ["2"]}. Rules: one leading "?" is ignored;
pairs are separated by "&" and empty pairs are skipped; a pair without "=" has value "";
only the first "=" splits ("k=a=b" -> {"k": ["a=b"]}); in keys and values "+" means a
space and %XX escapes are decoded as UTF-8 ("%C3%A9" -> "é"); values keep their order.
Do not use urllib.""",
    stub='''def parse_query(query: str) -> dict[str, list[str]]:
    """Parse a URL query string into key -> list of values."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from query import parse_query


class TestParseQuery(unittest.TestCase):
    def test_repeated_keys(self):
        self.assertEqual(parse_query("a=1&b=2&a=3"), {"a": ["1", "3"], "b": ["2"]})
''',
    hidden_tests='''from query import parse_query


def test_leading_question_mark_and_empty_pairs():
    assert parse_query("?x=1&&y=2&") == {"x": ["1"], "y": ["2"]}


def test_no_equals():
    assert parse_query("flag&k=v") == {"flag": [""], "k": ["v"]}


def test_first_equals_splits():
    assert parse_query("k=a=b") == {"k": ["a=b"]}


def test_decoding():
    assert parse_query("name=J%C3%A9r%C3%B4me+Doe&q=%2B1") == {"name": ["Jérôme Doe"], "q": ["+1"]}


def test_empty():
    assert parse_query("") == {}
    assert parse_query("?") == {}


def test_key_decoding():
    assert parse_query("a+b=1&c%3Dd=2") == {"a b": ["1"], "c=d": ["2"]}
''',
    reference='''_HEX = "0123456789abcdefABCDEF"


def _decode(text: str) -> str:
    out = bytearray()
    i = 0
    while i < len(text):
        ch = text[i]
        if ch == "%" and i + 3 <= len(text) and text[i + 1] in _HEX and text[i + 2] in _HEX:
            out.append(int(text[i + 1:i + 3], 16))
            i += 3
            continue
        out += b" " if ch == "+" else ch.encode()
        i += 1
    return out.decode("utf-8", errors="replace")


def parse_query(query: str) -> dict[str, list[str]]:
    if query.startswith("?"):
        query = query[1:]
    result: dict[str, list[str]] = {}
    for pair in query.split("&"):
        if not pair:
            continue
        key, _, value = pair.partition("=")
        result.setdefault(_decode(key), []).append(_decode(value))
    return result
''',
)

EVAL_RPN = CodeTaskSpec(
    name="eval_rpn",
    module="rpn.py",
    prompt="""Implement `eval_rpn(tokens: list[str]) -> float`, evaluating an expression in
reverse Polish notation: ["3", "4", "+", "2", "*"] -> 14. Tokens are numbers (ints or
decimals, possibly negative like "-2.5") or one of + - * /, where / is true division.
Return an int when the value is integral and no division happened, else a float (the
tests compare values with ==). Raise ValueError for: an empty token list, an unknown
token, an operator without two operands, numbers left over at the end, and division by
zero.""",
    stub='''def eval_rpn(tokens: list[str]) -> float:
    """Value of a reverse-Polish expression."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from rpn import eval_rpn


class TestEvalRpn(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(eval_rpn(["3", "4", "+", "2", "*"]), 14)
''',
    hidden_tests='''import pytest

from rpn import eval_rpn


def test_order_of_operands():
    assert eval_rpn(["10", "4", "-"]) == 6
    assert eval_rpn(["1", "4", "/"]) == 0.25


def test_negative_and_decimal():
    assert eval_rpn(["-2.5", "2", "*"]) == -5.0


def test_single_number():
    assert eval_rpn(["42"]) == 42


def test_errors():
    for bad in ([], ["+"], ["1", "+"], ["1", "2"], ["1", "x", "+"], ["1", "0", "/"]):
        with pytest.raises(ValueError):
            eval_rpn(bad)


def test_long():
    assert eval_rpn(["5", "1", "2", "+", "4", "*", "+", "3", "-"]) == 14
''',
    reference='''_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _number(token: str):
    try:
        return int(token)
    except ValueError:
        pass
    try:
        return float(token)
    except ValueError:
        raise ValueError(f"unknown token {token!r}") from None


def eval_rpn(tokens: list[str]) -> float:
    if not tokens:
        raise ValueError("empty expression")
    stack = []
    for token in tokens:
        if token in _OPS or token == "/":
            if len(stack) < 2:
                raise ValueError(f"operator {token!r} needs two operands")
            b, a = stack.pop(), stack.pop()
            if token == "/":
                if b == 0:
                    raise ValueError("division by zero")
                stack.append(a / b)
            else:
                stack.append(_OPS[token](a, b))
        else:
            stack.append(_number(token))
    if len(stack) != 1:
        raise ValueError("numbers left over")
    return stack[0]
''',
)

COMPARE_VERSIONS = CodeTaskSpec(
    name="compare_versions",
    module="versions.py",
    prompt="""Implement `compare_versions(a: str, b: str) -> int`, comparing dotted version
strings made of non-negative integers: -1 if a < b, 0 if equal, 1 if a > b. Parts are
compared numerically from the left ("1.10" > "1.9"), leading zeros do not matter
("1.01" == "1.1") and missing parts count as 0 ("1.0.0" == "1"). A version that is empty
or has an empty or non-digit part ("1..2", "1.a", "1.", "-1") raises ValueError.""",
    stub='''def compare_versions(a: str, b: str) -> int:
    """-1, 0 or 1 as dotted version a is lower, equal or higher than b."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from versions import compare_versions


class TestCompareVersions(unittest.TestCase):
    def test_numeric_parts(self):
        self.assertEqual(compare_versions("1.10", "1.9"), 1)
        self.assertEqual(compare_versions("1.2", "1.2"), 0)
''',
    hidden_tests='''import pytest

from versions import compare_versions


def test_missing_parts_are_zero():
    assert compare_versions("1.0.0", "1") == 0
    assert compare_versions("1", "1.0.1") == -1


def test_leading_zeros():
    assert compare_versions("1.01", "1.1") == 0


def test_lower():
    assert compare_versions("0.9.9", "1.0") == -1


def test_invalid():
    for bad in ("", "1..2", "1.a", "1.", "-1", " 1"):
        with pytest.raises(ValueError):
            compare_versions(bad, "1")
        with pytest.raises(ValueError):
            compare_versions("1", bad)


def test_long_versions():
    assert compare_versions("2.0.0.0.1", "2") == 1
''',
    reference='''def _parts(version: str) -> list[int]:
    parts = version.split(".")
    if not version or not all(p.isdigit() and p.isascii() for p in parts):
        raise ValueError(f"not a version: {version!r}")
    return [int(p) for p in parts]


def compare_versions(a: str, b: str) -> int:
    pa, pb = _parts(a), _parts(b)
    n = max(len(pa), len(pb))
    pa += [0] * (n - len(pa))
    pb += [0] * (n - len(pb))
    return (pa > pb) - (pa < pb)
''',
)

EXPAND_RANGES = CodeTaskSpec(
    name="expand_ranges",
    module="ranges.py",
    prompt="""Implement `expand_ranges(spec: str) -> list[int]`, expanding a page-range style
list: "1-3,5,7-8" -> [1, 2, 3, 5, 7, 8]. Parts are separated by commas and may have
spaces around them; a part is a non-negative integer or "a-b" with a <= b (both ends
included). The result is sorted and without duplicates. An empty or all-space spec gives
[]. Raise ValueError for an empty part ("1,,2"), a descending range ("5-3") or anything
that is not a number or range ("x", "1-", "1-2-3").""",
    stub='''def expand_ranges(spec: str) -> list[int]:
    """Numbers of a spec like "1-3,5" as a sorted list without duplicates."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from ranges import expand_ranges


class TestExpandRanges(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(expand_ranges("1-3,5,7-8"), [1, 2, 3, 5, 7, 8])
''',
    hidden_tests='''import pytest

from ranges import expand_ranges


def test_spaces_and_duplicates():
    assert expand_ranges(" 4 , 1-2, 2-4 ") == [1, 2, 3, 4]


def test_empty():
    assert expand_ranges("") == []
    assert expand_ranges("   ") == []


def test_single_point_range():
    assert expand_ranges("7-7") == [7]


def test_invalid():
    for bad in ("1,,2", "5-3", "x", "1-", "1-2-3", "-1"):
        with pytest.raises(ValueError):
            expand_ranges(bad)


def test_unsorted_input():
    assert expand_ranges("10,2,5-6") == [2, 5, 6, 10]
''',
    reference='''def expand_ranges(spec: str) -> list[int]:
    if not spec.strip():
        return []
    numbers: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        lo_text, dash, hi_text = part.partition("-")
        if not lo_text.isdigit() or (dash and not hi_text.isdigit()):
            raise ValueError(f"bad range part {part!r}")
        lo = int(lo_text)
        hi = int(hi_text) if dash else lo
        if lo > hi:
            raise ValueError(f"descending range {part!r}")
        numbers.update(range(lo, hi + 1))
    return sorted(numbers)
''',
)

TASKS = (PARSE_DURATION, SPLIT_CSV, PARSE_QUERY, EVAL_RPN, COMPARE_VERSIONS, EXPAND_RANGES)
