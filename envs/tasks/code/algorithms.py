"""Bundled code tasks about classic algorithms (see envs.tasks.code for the format)."""

from envs.tasks.code import CodeTaskSpec

FIRST_INDEX = CodeTaskSpec(
    name="first_index",
    module="search.py",
    prompt="""Implement `first_index(items: list[int], target: int) -> int`, where `items` is
sorted in non-decreasing order: the smallest index i with items[i] == target, or -1 if
`target` is absent. It must run in O(log n) time: a list of 2 million elements is
searched 20,000 times in the tests.""",
    stub='''def first_index(items: list[int], target: int) -> int:
    """Leftmost index of target in sorted items, or -1."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from search import first_index


class TestFirstIndex(unittest.TestCase):
    def test_duplicates(self):
        self.assertEqual(first_index([1, 2, 2, 2, 3], 2), 1)

    def test_absent(self):
        self.assertEqual(first_index([1, 3], 2), -1)
''',
    hidden_tests='''from search import first_index


def test_empty():
    assert first_index([], 5) == -1


def test_ends():
    assert first_index([4, 4, 5], 4) == 0
    assert first_index([1, 2, 9], 9) == 2


def test_outside_range():
    assert first_index([2, 3], 1) == -1
    assert first_index([2, 3], 4) == -1


def test_fast():
    items = [i // 2 for i in range(2_000_000)]
    for t in range(0, 1_000_000, 50):
        assert first_index(items, t) == 2 * t
''',
    reference='''def first_index(items: list[int], target: int) -> int:
    lo, hi = 0, len(items)
    while lo < hi:
        mid = (lo + hi) // 2
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid
    return lo if lo < len(items) and items[lo] == target else -1
''',
)

EDIT_DISTANCE = CodeTaskSpec(
    name="edit_distance",
    module="edits.py",
    prompt="""Implement `edit_distance(a: str, b: str) -> int`, the Levenshtein distance: the
fewest single-character insertions, deletions and substitutions that turn `a` into `b`
("kitten" -> "sitting" is 3). Strings of 1,000 characters must take well under a few
seconds.""",
    stub='''def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance between a and b."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from edits import edit_distance


class TestEditDistance(unittest.TestCase):
    def test_kitten(self):
        self.assertEqual(edit_distance("kitten", "sitting"), 3)
''',
    hidden_tests='''from edits import edit_distance


def test_empty():
    assert edit_distance("", "") == 0
    assert edit_distance("", "abc") == 3
    assert edit_distance("abc", "") == 3


def test_symmetric():
    assert edit_distance("flaw", "lawn") == edit_distance("lawn", "flaw") == 2


def test_identical():
    assert edit_distance("same", "same") == 0


def test_long():
    a = "ab" * 500
    b = "ba" * 500
    assert edit_distance(a, b) == 2


def test_substitutions_only():
    assert edit_distance("aaaa", "bbbb") == 4
''',
    reference='''def edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1,
                               previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]
''',
)

LIS = CodeTaskSpec(
    name="lis_length",
    module="lis.py",
    prompt="""Implement `lis_length(numbers: list[int]) -> int`, the length of the longest
strictly increasing subsequence (not necessarily contiguous):
[10, 9, 2, 5, 3, 7, 101, 18] -> 4 (e.g. 2, 3, 7, 18). An empty list gives 0. It must
handle 100,000 numbers quickly (O(n log n)).""",
    stub='''def lis_length(numbers: list[int]) -> int:
    """Length of the longest strictly increasing subsequence."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from lis import lis_length


class TestLisLength(unittest.TestCase):
    def test_example(self):
        self.assertEqual(lis_length([10, 9, 2, 5, 3, 7, 101, 18]), 4)
''',
    hidden_tests='''from lis import lis_length


def test_empty():
    assert lis_length([]) == 0


def test_strict():
    assert lis_length([7, 7, 7]) == 1


def test_decreasing():
    assert lis_length([5, 4, 3, 2, 1]) == 1


def test_large():
    numbers = [(i * 7919) % 100_003 for i in range(100_000)]
    assert lis_length(list(range(100_000))) == 100_000
    assert lis_length(numbers) > 0


def test_negative():
    assert lis_length([-3, -1, -2, 0]) == 3
''',
    reference='''from bisect import bisect_left


def lis_length(numbers: list[int]) -> int:
    tails: list[int] = []
    for x in numbers:
        i = bisect_left(tails, x)
        if i == len(tails):
            tails.append(x)
        else:
            tails[i] = x
    return len(tails)
''',
)

TOPO_ORDER = CodeTaskSpec(
    name="topo_order",
    module="topo.py",
    prompt="""Implement `topo_order(deps: dict[str, list[str]]) -> list[str]`. `deps[x]` lists
the items x depends on, which must come before x. Items that appear only as
dependencies are included too. Return every item once, dependencies first; whenever
several items are ready, take the alphabetically smallest first, so the answer is
unique: {"b": ["a"], "c": ["a"]} -> ["a", "b", "c"]. A cycle (including an item
depending on itself) raises ValueError. The input must not be modified.""",
    stub='''def topo_order(deps: dict[str, list[str]]) -> list[str]:
    """Items ordered dependencies-first, alphabetical among ready ones."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from topo import topo_order


class TestTopoOrder(unittest.TestCase):
    def test_example(self):
        self.assertEqual(topo_order({"b": ["a"], "c": ["a"]}), ["a", "b", "c"])
''',
    hidden_tests='''import pytest

from topo import topo_order


def test_alphabetical_among_ready():
    assert topo_order({"a": ["z"], "b": []}) == ["b", "z", "a"]


def test_chain():
    assert topo_order({"c": ["b"], "b": ["a"]}) == ["a", "b", "c"]


def test_cycle():
    with pytest.raises(ValueError):
        topo_order({"a": ["b"], "b": ["a"]})
    with pytest.raises(ValueError):
        topo_order({"a": ["a"]})


def test_empty():
    assert topo_order({}) == []


def test_input_unchanged():
    deps = {"b": ["a"]}
    topo_order(deps)
    assert deps == {"b": ["a"]}


def test_diamond():
    assert topo_order({"d": ["b", "c"], "b": ["a"], "c": ["a"]}) == ["a", "b", "c", "d"]
''',
    reference='''import heapq


def topo_order(deps: dict[str, list[str]]) -> list[str]:
    items = set(deps)
    for needed in deps.values():
        items.update(needed)
    waiting = {item: set(deps.get(item, ())) for item in items}
    users: dict[str, list[str]] = {item: [] for item in items}
    for item, needed in waiting.items():
        for d in needed:
            users[d].append(item)
    ready = [item for item, needed in waiting.items() if not needed]
    heapq.heapify(ready)
    order = []
    while ready:
        item = heapq.heappop(ready)
        order.append(item)
        for user in users[item]:
            waiting[user].discard(item)
            if not waiting[user]:
                heapq.heappush(ready, user)
    if len(order) != len(items):
        raise ValueError("dependency cycle")
    return order
''',
)

COUNT_CHANGE = CodeTaskSpec(
    name="count_change",
    module="change.py",
    prompt="""Implement `count_change(amount: int, coins: list[int]) -> int`, the number of
ways to make `amount` from unlimited coins of the given values, where order does not
matter: count_change(4, [1, 2]) -> 3 (1+1+1+1, 1+1+2, 2+2). Amount 0 has one way (no
coins). A coin value listed twice counts once. A negative amount or a coin value < 1
raises ValueError. count_change(10_000, [1, 5, 10, 25, 50, 100]) must be fast.""",
    stub='''def count_change(amount: int, coins: list[int]) -> int:
    """Number of coin combinations that sum to amount."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from change import count_change


class TestCountChange(unittest.TestCase):
    def test_example(self):
        self.assertEqual(count_change(4, [1, 2]), 3)
''',
    hidden_tests='''import pytest

from change import count_change


def test_zero_amount():
    assert count_change(0, [3]) == 1
    assert count_change(0, []) == 1


def test_impossible():
    assert count_change(3, [2]) == 0
    assert count_change(5, []) == 0


def test_duplicate_coins():
    assert count_change(4, [1, 2, 2, 1]) == 3


def test_invalid():
    with pytest.raises(ValueError):
        count_change(-1, [1])
    with pytest.raises(ValueError):
        count_change(5, [0, 1])


def test_large():
    assert count_change(100, [1, 5, 10, 25, 50]) == 292
    assert count_change(10_000, [1, 5, 10, 25, 50, 100]) > 0
''',
    reference='''def count_change(amount: int, coins: list[int]) -> int:
    if amount < 0:
        raise ValueError("amount must be >= 0")
    if any(c < 1 for c in coins):
        raise ValueError("coin values must be >= 1")
    ways = [1] + [0] * amount
    for coin in sorted(set(coins)):
        for value in range(coin, amount + 1):
            ways[value] += ways[value - coin]
    return ways[amount]
''',
)

KNIGHT = CodeTaskSpec(
    name="knight_distance",
    module="knight.py",
    prompt="""Implement `knight_distance(start: str, end: str) -> int`, the fewest moves a
chess knight needs on an empty 8x8 board to go from `start` to `end`. Squares are
written file then rank, "a1" to "h8" (lower-case file letter). Same square gives 0;
"a1" -> "b3" gives 1; "a1" -> "h8" gives 6. Anything that is not a square ("i1", "a9",
"A1", "a10", "") raises ValueError.""",
    stub='''def knight_distance(start: str, end: str) -> int:
    """Fewest knight moves from start to end on an 8x8 board."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from knight import knight_distance


class TestKnightDistance(unittest.TestCase):
    def test_one_move(self):
        self.assertEqual(knight_distance("a1", "b3"), 1)
''',
    hidden_tests='''import pytest

from knight import knight_distance


def test_same_square():
    assert knight_distance("d4", "d4") == 0


def test_corner_to_corner():
    assert knight_distance("a1", "h8") == 6


def test_corner_neighbour():
    assert knight_distance("a1", "b2") == 4


def test_invalid():
    for bad in ("i1", "a9", "A1", "a10", "", "a0"):
        with pytest.raises(ValueError):
            knight_distance(bad, "a1")
        with pytest.raises(ValueError):
            knight_distance("a1", bad)


def test_symmetric():
    assert knight_distance("c3", "g7") == knight_distance("g7", "c3")
''',
    reference='''from collections import deque


def _square(name: str) -> tuple[int, int]:
    if len(name) != 2 or name[0] not in "abcdefgh" or name[1] not in "12345678":
        raise ValueError(f"not a square: {name!r}")
    return ord(name[0]) - 97, int(name[1]) - 1


def knight_distance(start: str, end: str) -> int:
    src, dst = _square(start), _square(end)
    seen = {src: 0}
    queue = deque([src])
    while queue:
        x, y = queue.popleft()
        if (x, y) == dst:
            return seen[(x, y)]
        for dx, dy in ((1, 2), (2, 1), (-1, 2), (-2, 1), (1, -2), (2, -1), (-1, -2), (-2, -1)):
            nxt = (x + dx, y + dy)
            if 0 <= nxt[0] < 8 and 0 <= nxt[1] < 8 and nxt not in seen:
                seen[nxt] = seen[(x, y)] + 1
                queue.append(nxt)
    raise AssertionError("every square is reachable")
''',
)

TASKS = (FIRST_INDEX, EDIT_DISTANCE, LIS, TOPO_ORDER, COUNT_CHANGE, KNIGHT)
