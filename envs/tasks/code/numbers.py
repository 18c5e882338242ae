"""Bundled code tasks about numbers (see envs.tasks.code for the format)."""

from envs.tasks.code import CodeTaskSpec

DIGITAL_ROOT = CodeTaskSpec(
    name="digital_root",
    module="digits.py",
    prompt="""Implement `digital_root(n: int) -> int`: repeatedly replace a non-negative integer
by the sum of its decimal digits until one digit remains (9875 -> 29 -> 11 -> 2). 0 gives 0.
A negative `n` raises ValueError. It must be fast even for numbers with thousands of
digits.""",
    stub='''def digital_root(n: int) -> int:
    """Repeated digit sum of n >= 0, down to one digit."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from digits import digital_root


class TestDigitalRoot(unittest.TestCase):
    def test_example(self):
        self.assertEqual(digital_root(9875), 2)

    def test_single_digit(self):
        self.assertEqual(digital_root(7), 7)
''',
    hidden_tests='''import pytest

from digits import digital_root


def test_zero():
    assert digital_root(0) == 0


def test_multiples_of_nine():
    assert digital_root(18) == 9
    assert digital_root(999999) == 9


def test_negative():
    with pytest.raises(ValueError):
        digital_root(-5)


def test_huge():
    assert digital_root(int("7" * 3000)) == 3


def test_ten():
    assert digital_root(10) == 1
''',
    reference='''def digital_root(n: int) -> int:
    if n < 0:
        raise ValueError("n must be >= 0")
    return 0 if n == 0 else 1 + (n - 1) % 9
''',
)

_ROMAN_REFERENCE = '''_VALUES = ((1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
           (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I"))


def to_roman(n: int) -> str:
    if not isinstance(n, int) or not 1 <= n <= 3999:
        raise ValueError("n must be an int in 1..3999")
    out = []
    for value, symbol in _VALUES:
        while n >= value:
            out.append(symbol)
            n -= value
    return "".join(out)
'''

TO_ROMAN = CodeTaskSpec(
    name="to_roman",
    module="roman.py",
    prompt="""Implement `to_roman(n: int) -> str`, the standard Roman numeral of 1 <= n <= 3999
using subtractive pairs (4 -> "IV", 9 -> "IX", 40 -> "XL", 90 -> "XC", 400 -> "CD",
900 -> "CM"); e.g. 1994 -> "MCMXCIV". Values outside 1..3999 raise ValueError.""",
    stub='''def to_roman(n: int) -> str:
    """Roman numeral of 1 <= n <= 3999."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from roman import to_roman


class TestToRoman(unittest.TestCase):
    def test_examples(self):
        self.assertEqual(to_roman(1994), "MCMXCIV")
        self.assertEqual(to_roman(3), "III")
''',
    hidden_tests='''import pytest

from roman import to_roman


def test_subtractive_pairs():
    assert [to_roman(n) for n in (4, 9, 40, 90, 400, 900)] == ["IV", "IX", "XL", "XC", "CD", "CM"]


def test_bounds():
    assert to_roman(1) == "I"
    assert to_roman(3999) == "MMMCMXCIX"


def test_out_of_range():
    for bad in (0, -1, 4000):
        with pytest.raises(ValueError):
            to_roman(bad)


def test_misc():
    assert to_roman(2024) == "MMXXIV"
    assert to_roman(444) == "CDXLIV"
''',
    reference=_ROMAN_REFERENCE,
)

FROM_ROMAN = CodeTaskSpec(
    name="from_roman",
    module="unroman.py",
    prompt="""Implement `from_roman(text: str) -> int`, the value of a Roman numeral in
canonical form (upper case, subtractive pairs only where required, as written by the
standard rules: "MCMXCIV" -> 1994). Anything that is not the canonical numeral of a
number in 1..3999 raises ValueError: empty text, lower case, unknown letters,
non-canonical forms such as "IIII", "VV", "IC", "IM" or "XM".""",
    stub='''def from_roman(text: str) -> int:
    """Value of a canonical Roman numeral (1..3999)."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from unroman import from_roman


class TestFromRoman(unittest.TestCase):
    def test_examples(self):
        self.assertEqual(from_roman("MCMXCIV"), 1994)
        self.assertEqual(from_roman("XII"), 12)
''',
    hidden_tests='''import pytest

from unroman import from_roman


def test_subtractive():
    assert from_roman("IV") == 4
    assert from_roman("CDXLIV") == 444


def test_max():
    assert from_roman("MMMCMXCIX") == 3999


@pytest.mark.parametrize("bad", ["", "iv", "IIII", "VV", "IC", "IM", "XM", "MMMM", "ABC"])
def test_rejects(bad):
    with pytest.raises(ValueError):
        from_roman(bad)


def test_roundtrip_sample():
    assert [from_roman(s) for s in ("I", "XL", "XC", "CM", "MMXXIV")] == [1, 40, 90, 900, 2024]
''',
    reference=_ROMAN_REFERENCE + '''

_SYMBOLS = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}


def from_roman(text: str) -> int:
    if not text or any(ch not in _SYMBOLS for ch in text):
        raise ValueError(f"not a Roman numeral: {text!r}")
    total = 0
    for i, ch in enumerate(text):
        value = _SYMBOLS[ch]
        if i + 1 < len(text) and _SYMBOLS[text[i + 1]] > value:
            total -= value
        else:
            total += value
    if not 1 <= total <= 3999 or to_roman(total) != text:
        raise ValueError(f"not a canonical Roman numeral: {text!r}")
    return total
''',
)

PRIMES = CodeTaskSpec(
    name="primes_up_to",
    module="primes.py",
    prompt="""Implement `primes_up_to(n: int) -> list[int]`, all primes p with 2 <= p <= n in
increasing order (n = 10 -> [2, 3, 5, 7]). n < 2 gives []. It must handle n = 1_000_000
in well under a second.""",
    stub='''def primes_up_to(n: int) -> list[int]:
    """All primes <= n, increasing."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from primes import primes_up_to


class TestPrimes(unittest.TestCase):
    def test_ten(self):
        self.assertEqual(primes_up_to(10), [2, 3, 5, 7])
''',
    hidden_tests='''from primes import primes_up_to


def test_small():
    assert primes_up_to(2) == [2]
    assert primes_up_to(1) == []
    assert primes_up_to(0) == []
    assert primes_up_to(-7) == []


def test_inclusive():
    assert primes_up_to(13)[-1] == 13


def test_count_million():
    assert len(primes_up_to(1_000_000)) == 78498


def test_thirty():
    assert primes_up_to(30) == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29]
''',
    reference='''def primes_up_to(n: int) -> list[int]:
    if n < 2:
        return []
    sieve = bytearray([1]) * (n + 1)
    sieve[0] = sieve[1] = 0
    for p in range(2, int(n ** 0.5) + 1):
        if sieve[p]:
            sieve[p * p::p] = bytearray(len(range(p * p, n + 1, p)))
    return [i for i, flag in enumerate(sieve) if flag]
''',
)

LCM_ALL = CodeTaskSpec(
    name="lcm_all",
    module="lcm.py",
    prompt="""Implement `lcm_all(numbers: list[int]) -> int`, the least common multiple of all
the numbers. Negative numbers count by their absolute value, any 0 makes the result 0,
and an empty list gives 1. Results may be very large (Python ints).""",
    stub='''def lcm_all(numbers: list[int]) -> int:
    """Least common multiple of all numbers (empty -> 1)."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from lcm import lcm_all


class TestLcmAll(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(lcm_all([4, 6]), 12)
        self.assertEqual(lcm_all([2, 3, 5]), 30)
''',
    hidden_tests='''from lcm import lcm_all


def test_empty():
    assert lcm_all([]) == 1


def test_zero():
    assert lcm_all([3, 0, 5]) == 0


def test_negative():
    assert lcm_all([-4, 6]) == 12


def test_big():
    assert lcm_all(list(range(1, 31))) == 2329089562800


def test_single():
    assert lcm_all([7]) == 7
''',
    reference='''from math import gcd


def lcm_all(numbers: list[int]) -> int:
    result = 1
    for n in numbers:
        n = abs(n)
        if n == 0:
            return 0
        result = result * n // gcd(result, n)
    return result
''',
)

TO_BASE = CodeTaskSpec(
    name="to_base",
    module="bases.py",
    prompt="""Implement `to_base(n: int, base: int) -> str`, the representation of the integer
`n` in `base` (2..36) with digits 0-9 then lower-case a-z: to_base(255, 16) -> "ff". Zero
is "0"; a negative number gets a leading "-" (to_base(-10, 2) -> "-1010"). A base
outside 2..36 raises ValueError.""",
    stub='''def to_base(n: int, base: int) -> str:
    """n written in base 2..36 with digits 0-9a-z."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from bases import to_base


class TestToBase(unittest.TestCase):
    def test_hex(self):
        self.assertEqual(to_base(255, 16), "ff")

    def test_binary(self):
        self.assertEqual(to_base(5, 2), "101")
''',
    hidden_tests='''import pytest

from bases import to_base


def test_zero():
    assert to_base(0, 7) == "0"


def test_negative():
    assert to_base(-10, 2) == "-1010"


def test_base36():
    assert to_base(35, 36) == "z"
    assert to_base(36, 36) == "10"


def test_bad_base():
    for base in (1, 0, 37, -2):
        with pytest.raises(ValueError):
            to_base(10, base)


def test_big():
    assert to_base(2 ** 100, 16) == "1" + "0" * 25
''',
    reference='''_DIGITS = "0123456789abcdefghijklmnopqrstuvwxyz"


def to_base(n: int, base: int) -> str:
    if not 2 <= base <= 36:
        raise ValueError("base must be in 2..36")
    if n == 0:
        return "0"
    sign = "-" if n < 0 else ""
    n = abs(n)
    out = []
    while n:
        n, r = divmod(n, base)
        out.append(_DIGITS[r])
    return sign + "".join(reversed(out))
''',
)

TASKS = (DIGITAL_ROOT, TO_ROMAN, FROM_ROMAN, PRIMES, LCM_ALL, TO_BASE)
