"""Bundled code tasks about small data structures and dates (see envs.tasks.code)."""

from envs.tasks.code import CodeTaskSpec

LRU = CodeTaskSpec(
    name="lru_cache",
    module="lru.py",
    prompt="""Implement a class `LRUCache(capacity: int)` holding at most `capacity` entries:
`get(key, default=None)` returns the value (or `default`) and marks the key as most
recently used; `put(key, value)` inserts or updates the key, marks it most recently
used, and when the cache is over capacity evicts the least recently used entry;
`len(cache)` is the number of entries. A capacity < 1 raises ValueError. get and put
must be O(1).""",
    stub='''class LRUCache:
    """Least-recently-used cache of at most `capacity` entries."""

    def __init__(self, capacity: int) -> None:
        raise NotImplementedError

    def get(self, key, default=None):
        raise NotImplementedError

    def put(self, key, value) -> None:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError
''',
    visible_tests='''import unittest

from lru import LRUCache


class TestLRUCache(unittest.TestCase):
    def test_evicts_least_recent(self):
        cache = LRUCache(2)
        cache.put("a", 1)
        cache.put("b", 2)
        cache.put("c", 3)
        self.assertIsNone(cache.get("a"))
        self.assertEqual(cache.get("c"), 3)
''',
    hidden_tests='''import pytest

from lru import LRUCache


def test_get_refreshes():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1
    cache.put("c", 3)
    assert cache.get("b") is None
    assert cache.get("a") == 1


def test_update_refreshes_and_keeps_size():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("a", 10)
    cache.put("c", 3)
    assert len(cache) == 2
    assert cache.get("a") == 10
    assert cache.get("b", "gone") == "gone"


def test_capacity_one():
    cache = LRUCache(1)
    cache.put(1, "x")
    cache.put(2, "y")
    assert len(cache) == 1 and cache.get(1) is None and cache.get(2) == "y"


def test_bad_capacity():
    with pytest.raises(ValueError):
        LRUCache(0)


def test_many_operations():
    cache = LRUCache(1000)
    for i in range(200_000):
        cache.put(i, i)
    assert len(cache) == 1000
    assert cache.get(198_999) is None
    assert cache.get(199_000) == 199_000
    assert cache.get(199_999) == 199_999
''',
    reference='''from collections import OrderedDict


class LRUCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._data: OrderedDict = OrderedDict()

    def get(self, key, default=None):
        if key not in self._data:
            return default
        self._data.move_to_end(key)
        return self._data[key]

    def put(self, key, value) -> None:
        self._data[key] = value
        self._data.move_to_end(key)
        if len(self._data) > self.capacity:
            self._data.popitem(last=False)

    def __len__(self) -> int:
        return len(self._data)
''',
)

DAY_OF_YEAR = CodeTaskSpec(
    name="day_of_year",
    module="calendar_day.py",
    prompt="""Implement `day_of_year(year: int, month: int, day: int) -> int`, the 1-based day
number within the year in the proleptic Gregorian calendar: (2024, 3, 1) -> 61. Leap
years are divisible by 4, except centuries not divisible by 400 (2000 is leap, 1900 is
not). Years 1..9999 are valid. An invalid date (month 13, day 0, February 29 of a common
year, April 31, year 0) raises ValueError. Do not use the datetime or calendar modules.""",
    stub='''def day_of_year(year: int, month: int, day: int) -> int:
    """1-based day number of a Gregorian date within its year."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from calendar_day import day_of_year


class TestDayOfYear(unittest.TestCase):
    def test_leap_march(self):
        self.assertEqual(day_of_year(2024, 3, 1), 61)

    def test_new_year(self):
        self.assertEqual(day_of_year(2023, 1, 1), 1)
''',
    hidden_tests='''import pytest

from calendar_day import day_of_year


def test_century_rules():
    assert day_of_year(2000, 12, 31) == 366
    assert day_of_year(1900, 12, 31) == 365
    assert day_of_year(1900, 3, 1) == 60


def test_invalid_dates():
    for bad in ((2023, 2, 29), (2023, 13, 1), (2023, 0, 5), (2023, 4, 31), (2023, 1, 0),
                (0, 1, 1), (10000, 1, 1)):
        with pytest.raises(ValueError):
            day_of_year(*bad)


def test_leap_day():
    assert day_of_year(2024, 2, 29) == 60


def test_end_of_common_year():
    assert day_of_year(2023, 12, 31) == 365
''',
    reference='''_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def _is_leap(year: int) -> bool:
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def day_of_year(year: int, month: int, day: int) -> int:
    if not 1 <= year <= 9999 or not 1 <= month <= 12:
        raise ValueError("invalid date")
    lengths = list(_DAYS)
    if _is_leap(year):
        lengths[1] = 29
    if not 1 <= day <= lengths[month - 1]:
        raise ValueError("invalid date")
    return sum(lengths[:month - 1]) + day
''',
)

MIN_STACK = CodeTaskSpec(
    name="min_stack",
    module="minstack.py",
    prompt="""Implement a class `MinStack` (no constructor arguments) with `push(x)`, `pop()`
(removes and returns the top), `top()` (returns the top without removing it), `min()`
(the smallest value currently on the stack) and `len(stack)`. All operations are O(1).
pop, top and min on an empty stack raise IndexError. Values are comparable numbers and
may repeat.""",
    stub='''class MinStack:
    """A stack that also reports its minimum in O(1)."""

    def push(self, x) -> None:
        raise NotImplementedError

    def pop(self):
        raise NotImplementedError

    def top(self):
        raise NotImplementedError

    def min(self):
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError
''',
    visible_tests='''import unittest

from minstack import MinStack


class TestMinStack(unittest.TestCase):
    def test_min_follows_pops(self):
        s = MinStack()
        s.push(3)
        s.push(1)
        s.push(2)
        self.assertEqual(s.min(), 1)
        self.assertEqual(s.pop(), 2)
        self.assertEqual(s.pop(), 1)
        self.assertEqual(s.min(), 3)
''',
    hidden_tests='''import pytest

from minstack import MinStack


def test_repeated_minimum():
    s = MinStack()
    for x in (2, 1, 1):
        s.push(x)
    s.pop()
    assert s.min() == 1
    s.pop()
    assert s.min() == 2


def test_empty_raises():
    s = MinStack()
    for op in (s.pop, s.top, s.min):
        with pytest.raises(IndexError):
            op()


def test_top_and_len():
    s = MinStack()
    s.push(5)
    s.push(7)
    assert s.top() == 7 and len(s) == 2
    assert s.top() == 7 and len(s) == 2


def test_negative_values():
    s = MinStack()
    for x in (0, -3, 4, -3):
        s.push(x)
    assert s.min() == -3
    s.pop()
    s.pop()
    assert s.min() == -3


def test_drained_then_reused():
    s = MinStack()
    s.push(1)
    s.pop()
    assert len(s) == 0
    s.push(9)
    assert s.min() == 9
''',
    reference='''class MinStack:
    def __init__(self) -> None:
        self._items: list = []
        self._mins: list = []

    def push(self, x) -> None:
        self._items.append(x)
        self._mins.append(x if not self._mins else min(x, self._mins[-1]))

    def pop(self):
        if not self._items:
            raise IndexError("pop from an empty stack")
        self._mins.pop()
        return self._items.pop()

    def top(self):
        if not self._items:
            raise IndexError("top of an empty stack")
        return self._items[-1]

    def min(self):
        if not self._mins:
            raise IndexError("min of an empty stack")
        return self._mins[-1]

    def __len__(self) -> int:
        return len(self._items)
''',
)

TASKS = (LRU, DAY_OF_YEAR, MIN_STACK)
