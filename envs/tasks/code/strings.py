"""Bundled code tasks about strings (see envs.tasks.code for the format)."""

from envs.tasks.code import CodeTaskSpec

RUN_LENGTH = CodeTaskSpec(
    name="run_length_encode",
    module="rle.py",
    prompt="""Implement `rle_encode(text: str) -> str`, a run-length encoding: every maximal run
of one repeated character becomes the run's length followed by the character, e.g.
"aaabcc" -> "3a1b2c". Characters are compared exactly (so "aA" -> "1a1A"), any character
may appear (digits and spaces too), runs longer than 9 write their full length ("12x"),
and the empty string encodes to "".""",
    stub='''def rle_encode(text: str) -> str:
    """Run-length encode `text`: "aaabcc" -> "3a1b2c"."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from rle import rle_encode


class TestRleEncode(unittest.TestCase):
    def test_runs(self):
        self.assertEqual(rle_encode("aaabcc"), "3a1b2c")

    def test_single_characters(self):
        self.assertEqual(rle_encode("abc"), "1a1b1c")
''',
    hidden_tests='''from rle import rle_encode


def test_empty():
    assert rle_encode("") == ""


def test_case_sensitive():
    assert rle_encode("aAAa") == "1a2A1a"


def test_long_run():
    assert rle_encode("x" * 12 + "y") == "12x1y"


def test_digits_and_spaces():
    assert rle_encode("11  2") == "21" + "2 " + "12"


def test_one_char():
    assert rle_encode("z") == "1z"
''',
    reference='''def rle_encode(text: str) -> str:
    out = []
    i = 0
    while i < len(text):
        j = i
        while j < len(text) and text[j] == text[i]:
            j += 1
        out.append(f"{j - i}{text[i]}")
        i = j
    return "".join(out)
''',
)

SHIFT_LETTERS = CodeTaskSpec(
    name="shift_letters",
    module="shift.py",
    prompt="""Implement `shift_letters(text: str, k: int) -> str`, which moves every ASCII letter
`k` places along the alphabet, wrapping around (z + 1 -> a) and keeping its case. `k` may
be negative or larger than 26. Every other character (digits, punctuation, spaces,
non-ASCII letters such as "é") is left unchanged.""",
    stub='''def shift_letters(text: str, k: int) -> str:
    """Shift ASCII letters by k places, wrapping, keeping case."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from shift import shift_letters


class TestShiftLetters(unittest.TestCase):
    def test_forward(self):
        self.assertEqual(shift_letters("abc", 1), "bcd")

    def test_keeps_case(self):
        self.assertEqual(shift_letters("Hello", 3), "Khoor")
''',
    hidden_tests='''from shift import shift_letters


def test_wraps():
    assert shift_letters("xyz XYZ", 3) == "abc ABC"


def test_negative():
    assert shift_letters("abc", -1) == "zab"


def test_large_k():
    assert shift_letters("Hello", 29) == "Khoor"
    assert shift_letters("Hello", -52) == "Hello"


def test_other_characters_unchanged():
    assert shift_letters("a1, b2! é", 1) == "b1, c2! é"


def test_zero():
    assert shift_letters("Same", 0) == "Same"
''',
    reference='''def shift_letters(text: str, k: int) -> str:
    out = []
    for ch in text:
        if "a" <= ch <= "z":
            out.append(chr((ord(ch) - 97 + k) % 26 + 97))
        elif "A" <= ch <= "Z":
            out.append(chr((ord(ch) - 65 + k) % 26 + 65))
        else:
            out.append(ch)
    return "".join(out)
''',
)

BALANCED = CodeTaskSpec(
    name="balanced_brackets",
    module="brackets.py",
    prompt="""Implement `is_balanced(text: str) -> bool`: True when the brackets (), [] and {}
in `text` are balanced and properly nested, e.g. "a[b{c}](d)" -> True, "([)]" -> False,
"(" -> False. All other characters are ignored; a text without brackets is balanced.""",
    stub='''def is_balanced(text: str) -> bool:
    """True if (), [] and {} in text are balanced and properly nested."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from brackets import is_balanced


class TestIsBalanced(unittest.TestCase):
    def test_nested(self):
        self.assertTrue(is_balanced("a[b{c}](d)"))

    def test_crossed(self):
        self.assertFalse(is_balanced("([)]"))
''',
    hidden_tests='''from brackets import is_balanced


def test_empty_and_plain_text():
    assert is_balanced("")
    assert is_balanced("no brackets here")


def test_unclosed():
    assert not is_balanced("(")
    assert not is_balanced("{[]")


def test_closing_first():
    assert not is_balanced(")(")
    assert not is_balanced("]")


def test_deep_nesting():
    assert is_balanced("{" * 50 + "[()]" + "}" * 50)


def test_wrong_closer():
    assert not is_balanced("(]")
''',
    reference='''def is_balanced(text: str) -> bool:
    pairs = {")": "(", "]": "[", "}": "{"}
    stack = []
    for ch in text:
        if ch in "([{":
            stack.append(ch)
        elif ch in pairs:
            if not stack or stack.pop() != pairs[ch]:
                return False
    return not stack
''',
)

SNAKE_TO_CAMEL = CodeTaskSpec(
    name="snake_to_camel",
    module="naming.py",
    prompt="""Implement `snake_to_camel(name: str) -> str`, turning a snake_case identifier into
camelCase: "parse_http_response" -> "parseHttpResponse". Rules: the first word is kept as
is; each later word gets its first letter upper-cased and the rest kept ("parse_HTTP_code"
-> "parseHTTPCode"); a run of several underscores between words is one separator
("a__b" -> "aB"); leading and trailing underscores are kept ("_private_name_" ->
"_privateName_"); a name without underscores is returned unchanged.""",
    stub='''def snake_to_camel(name: str) -> str:
    """snake_case -> camelCase, keeping leading/trailing underscores."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from naming import snake_to_camel


class TestSnakeToCamel(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(snake_to_camel("parse_http_response"), "parseHttpResponse")

    def test_no_underscore(self):
        self.assertEqual(snake_to_camel("value"), "value")
''',
    hidden_tests='''from naming import snake_to_camel


def test_keeps_rest_of_word():
    assert snake_to_camel("parse_HTTP_code") == "parseHTTPCode"


def test_repeated_underscores():
    assert snake_to_camel("a__b___c") == "aBC"


def test_leading_and_trailing():
    assert snake_to_camel("_private_name_") == "_privateName_"
    assert snake_to_camel("__dunder_name__") == "__dunderName__"


def test_first_word_unchanged():
    assert snake_to_camel("Already_camel") == "AlreadyCamel"


def test_digits():
    assert snake_to_camel("version_2_final") == "version2Final"
''',
    reference='''def snake_to_camel(name: str) -> str:
    core = name.strip("_")
    if not core:
        return name
    lead = name[: len(name) - len(name.lstrip("_"))]
    trail = name[len(name.rstrip("_")):]
    words = [w for w in core.split("_") if w]
    return lead + words[0] + "".join(w[0].upper() + w[1:] for w in words[1:]) + trail
''',
)

WRAP_WORDS = CodeTaskSpec(
    name="wrap_words",
    module="wrap.py",
    prompt="""Implement `wrap_words(text: str, width: int) -> list[str]`, a greedy word wrap.
Words are separated by any whitespace. Each line holds as many words as fit, joined by
single spaces, with length at most `width`. A word longer than `width` starts a new line
and is cut into pieces of `width` characters, each on its own line (the last piece may
share its line with the following words if they fit). An empty or all-whitespace text
gives []. `width` < 1 raises ValueError.""",
    stub='''def wrap_words(text: str, width: int) -> list[str]:
    """Greedy word wrap to lines of at most `width` characters."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from wrap import wrap_words


class TestWrapWords(unittest.TestCase):
    def test_greedy(self):
        self.assertEqual(wrap_words("the quick brown fox", 10), ["the quick", "brown fox"])

    def test_fits_one_line(self):
        self.assertEqual(wrap_words("a b c", 5), ["a b c"])
''',
    hidden_tests='''import pytest

from wrap import wrap_words


def test_empty():
    assert wrap_words("", 5) == []
    assert wrap_words("   ", 5) == []


def test_whitespace_collapsed():
    assert wrap_words("a\\n\\tb   c", 3) == ["a b", "c"]


def test_long_word_is_cut():
    assert wrap_words("abcdefghij", 4) == ["abcd", "efgh", "ij"]


def test_long_word_piece_shares_line():
    assert wrap_words("xx abcdefg h", 4) == ["xx", "abcd", "efg", "h"]
    assert wrap_words("abcdef g", 4) == ["abcd", "ef g"]


def test_bad_width():
    with pytest.raises(ValueError):
        wrap_words("a", 0)


def test_exact_width():
    assert wrap_words("abc def", 7) == ["abc def"]
''',
    reference='''def wrap_words(text: str, width: int) -> list[str]:
    if width < 1:
        raise ValueError("width must be >= 1")
    lines = []
    current = ""
    for word in text.split():
        if len(word) > width:
            if current:
                lines.append(current)
            pieces = [word[i:i + width] for i in range(0, len(word), width)]
            lines.extend(pieces[:-1])
            current = pieces[-1]
        elif not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines
''',
)

COMMON_PREFIX = CodeTaskSpec(
    name="common_prefix",
    module="prefix.py",
    prompt="""Implement `common_prefix(words: list[str]) -> str`, the longest string that every
word starts with: ["flower", "flow", "flight"] -> "fl". Comparison is case-sensitive. An
empty list gives "", a single word gives itself, and the input list must not be
modified.""",
    stub='''def common_prefix(words: list[str]) -> str:
    """Longest common prefix of all words."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from prefix import common_prefix


class TestCommonPrefix(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(common_prefix(["flower", "flow", "flight"]), "fl")

    def test_none(self):
        self.assertEqual(common_prefix(["dog", "car"]), "")
''',
    hidden_tests='''from prefix import common_prefix


def test_empty_list():
    assert common_prefix([]) == ""


def test_single_word():
    assert common_prefix(["alone"]) == "alone"


def test_case_sensitive():
    assert common_prefix(["Apple", "apple"]) == ""


def test_word_is_prefix_of_others():
    assert common_prefix(["inter", "internet", "interval"]) == "inter"


def test_empty_word():
    assert common_prefix(["abc", ""]) == ""


def test_input_not_modified():
    words = ["b", "a"]
    common_prefix(words)
    assert words == ["b", "a"]
''',
    reference='''def common_prefix(words: list[str]) -> str:
    if not words:
        return ""
    prefix = words[0]
    for word in words[1:]:
        n = 0
        while n < min(len(prefix), len(word)) and prefix[n] == word[n]:
            n += 1
        prefix = prefix[:n]
    return prefix
''',
)

TASKS = (RUN_LENGTH, SHIFT_LETTERS, BALANCED, SNAKE_TO_CAMEL, WRAP_WORDS, COMMON_PREFIX)
