"""Bundled code tasks about lists and sequences (see envs.tasks.code for the format)."""

from envs.tasks.code import CodeTaskSpec

CHUNKED = CodeTaskSpec(
    name="chunked",
    module="chunks.py",
    prompt="""Implement `chunked(items: list, size: int) -> list[list]`, which splits `items`
into consecutive lists of `size` elements; the last one may be shorter:
chunked([1, 2, 3, 4, 5], 2) -> [[1, 2], [3, 4], [5]]. An empty list gives []. `size` < 1
raises ValueError. The input list must not be modified, and the result must not share
list objects with it.""",
    stub='''def chunked(items: list, size: int) -> list[list]:
    """Split items into consecutive lists of `size` elements."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from chunks import chunked


class TestChunked(unittest.TestCase):
    def test_uneven(self):
        self.assertEqual(chunked([1, 2, 3, 4, 5], 2), [[1, 2], [3, 4], [5]])
''',
    hidden_tests='''import pytest

from chunks import chunked


def test_empty():
    assert chunked([], 3) == []


def test_size_larger_than_list():
    assert chunked([1, 2], 5) == [[1, 2]]


def test_bad_size():
    for size in (0, -1):
        with pytest.raises(ValueError):
            chunked([1], size)


def test_no_sharing():
    items = [1, 2, 3]
    result = chunked(items, 3)
    result[0].append(4)
    assert items == [1, 2, 3]


def test_even():
    assert chunked(list("abcdef"), 3) == [["a", "b", "c"], ["d", "e", "f"]]
''',
    reference='''def chunked(items: list, size: int) -> list[list]:
    if size < 1:
        raise ValueError("size must be >= 1")
    return [list(items[i:i + size]) for i in range(0, len(items), size)]
''',
)

FLATTEN = CodeTaskSpec(
    name="flatten",
    module="flat.py",
    prompt="""Implement `flatten(nested) -> list`, which flattens lists and tuples nested to any
depth into one list, in order: flatten([1, [2, (3, [4])], 5]) -> [1, 2, 3, 4, 5]. Only lists
and tuples are opened; everything else, including strings, bytes, dicts and sets, is
kept as a single element. Nesting 10,000 levels deep must work (no recursion limit
error).""",
    stub='''def flatten(nested) -> list:
    """Flatten nested lists/tuples into one list."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from flat import flatten


class TestFlatten(unittest.TestCase):
    def test_mixed(self):
        self.assertEqual(flatten([1, [2, (3, [4])], 5]), [1, 2, 3, 4, 5])
''',
    hidden_tests='''from flat import flatten


def test_strings_are_atoms():
    assert flatten(["ab", ["cd"], b"ef"]) == ["ab", "cd", b"ef"]


def test_other_containers_are_atoms():
    d, s = {"k": 1}, {2}
    assert flatten([d, [s]]) == [d, s]


def test_empty():
    assert flatten([]) == []
    assert flatten([[], [[]], ()]) == []


def test_deep():
    nested = [0]
    for i in range(1, 10_000):
        nested = [nested, i]
    assert flatten(nested) == list(range(10_000))


def test_tuple_top_level():
    assert flatten((1, (2,))) == [1, 2]
''',
    reference='''def flatten(nested) -> list:
    out = []
    stack = [iter(nested)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, (list, tuple)):
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out
''',
)

MERGE_INTERVALS = CodeTaskSpec(
    name="merge_intervals",
    module="intervals.py",
    prompt="""Implement `merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]`.
Each interval (start, end) is closed, with start <= end. Return the union as a list of
disjoint intervals sorted by start, merging overlapping and touching ones:
[(5, 7), (1, 3), (2, 4)] -> [(1, 4), (5, 7)]; (1, 3) and (3, 5) merge into (1, 5), but
(1, 2) and (3, 4) stay apart. An interval with start > end raises ValueError. Empty input
gives [].""",
    stub='''def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Union of closed intervals, sorted and disjoint."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from intervals import merge_intervals


class TestMergeIntervals(unittest.TestCase):
    def test_unsorted_overlap(self):
        self.assertEqual(merge_intervals([(5, 7), (1, 3), (2, 4)]), [(1, 4), (5, 7)])
''',
    hidden_tests='''import pytest

from intervals import merge_intervals


def test_touching_merge():
    assert merge_intervals([(1, 3), (3, 5)]) == [(1, 5)]


def test_adjacent_integers_stay_apart():
    assert merge_intervals([(1, 2), (3, 4)]) == [(1, 2), (3, 4)]


def test_contained():
    assert merge_intervals([(1, 10), (2, 3), (4, 12)]) == [(1, 12)]


def test_empty_and_points():
    assert merge_intervals([]) == []
    assert merge_intervals([(2, 2), (2, 2)]) == [(2, 2)]


def test_invalid():
    with pytest.raises(ValueError):
        merge_intervals([(3, 1)])


def test_negative():
    assert merge_intervals([(-5, -1), (-2, 0)]) == [(-5, 0)]
''',
    reference='''def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    for start, end in intervals:
        if start > end:
            raise ValueError(f"interval ({start}, {end}) has start > end")
    merged: list[tuple[int, int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
''',
)

ROTATE = CodeTaskSpec(
    name="rotate_clockwise",
    module="rotate.py",
    prompt="""Implement `rotate_clockwise(matrix: list[list]) -> list[list]`, returning a new
matrix that is `matrix` rotated 90 degrees clockwise: [[1, 2], [3, 4]] -> [[3, 1], [4, 2]].
Rectangular matrices work too (an R x C matrix becomes C x R). An empty matrix ([])
gives []. The input must not be modified.""",
    stub='''def rotate_clockwise(matrix: list[list]) -> list[list]:
    """The matrix rotated 90 degrees clockwise (a new list)."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from rotate import rotate_clockwise


class TestRotate(unittest.TestCase):
    def test_square(self):
        self.assertEqual(rotate_clockwise([[1, 2], [3, 4]]), [[3, 1], [4, 2]])
''',
    hidden_tests='''from rotate import rotate_clockwise


def test_rectangle():
    assert rotate_clockwise([[1, 2, 3], [4, 5, 6]]) == [[4, 1], [5, 2], [6, 3]]


def test_column():
    assert rotate_clockwise([[1], [2], [3]]) == [[3, 2, 1]]


def test_empty():
    assert rotate_clockwise([]) == []


def test_four_turns_identity():
    m = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    r = m
    for _ in range(4):
        r = rotate_clockwise(r)
    assert r == m


def test_input_unchanged():
    m = [[1, 2], [3, 4]]
    rotate_clockwise(m)
    assert m == [[1, 2], [3, 4]]
''',
    reference='''def rotate_clockwise(matrix: list[list]) -> list[list]:
    if not matrix:
        return []
    return [list(row) for row in zip(*reversed(matrix))]
''',
)

GROUP_ANAGRAMS = CodeTaskSpec(
    name="group_anagrams",
    module="anagrams.py",
    prompt="""Implement `group_anagrams(words: list[str]) -> list[list[str]]`. Two words are
anagrams when they have the same letters with the same counts, ignoring case ("Listen"
and "silent"). Return the groups, each sorted with `sorted()` (original spelling kept,
duplicates kept), and the groups ordered by their first element:
["bat", "tab", "cat"] -> [["bat", "tab"], ["cat"]]. Empty input gives [].""",
    stub='''def group_anagrams(words: list[str]) -> list[list[str]]:
    """Group case-insensitive anagrams; groups sorted, ordered by first element."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from anagrams import group_anagrams


class TestGroupAnagrams(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(group_anagrams(["bat", "tab", "cat"]), [["bat", "tab"], ["cat"]])
''',
    hidden_tests='''from anagrams import group_anagrams


def test_case_insensitive():
    assert group_anagrams(["Listen", "silent", "enlist"]) == [["Listen", "enlist", "silent"]]


def test_duplicates_kept():
    assert group_anagrams(["ab", "ba", "ab"]) == [["ab", "ab", "ba"]]


def test_empty():
    assert group_anagrams([]) == []


def test_group_order():
    assert group_anagrams(["zz", "b", "a"]) == [["a"], ["b"], ["zz"]]


def test_counts_matter():
    assert group_anagrams(["aab", "abb"]) == [["aab"], ["abb"]]
''',
    reference='''def group_anagrams(words: list[str]) -> list[list[str]]:
    groups: dict[str, list[str]] = {}
    for word in words:
        groups.setdefault("".join(sorted(word.lower())), []).append(word)
    return sorted((sorted(g) for g in groups.values()), key=lambda g: g[0])
''',
)

TOP_K = CodeTaskSpec(
    name="top_k_frequent",
    module="frequent.py",
    prompt="""Implement `top_k_frequent(items: list, k: int) -> list`, the `k` most frequent
distinct items, most frequent first; items with equal counts are ordered by their first
occurrence in `items`: top_k_frequent(["b", "a", "b", "c", "a"], 2) -> ["b", "a"]. If `k`
exceeds the number of distinct items, all of them are returned; k = 0 gives []; k < 0
raises ValueError. Items are hashable.""",
    stub='''def top_k_frequent(items: list, k: int) -> list:
    """The k most frequent items; ties by first occurrence."""
    raise NotImplementedError
''',
    visible_tests='''import unittest

from frequent import top_k_frequent


class TestTopK(unittest.TestCase):
    def test_basic(self):
        self.assertEqual(top_k_frequent(["b", "a", "b", "c", "a"], 2), ["b", "a"])
''',
    hidden_tests='''import pytest

from frequent import top_k_frequent


def test_ties_by_first_occurrence():
    assert top_k_frequent(["x", "y", "z", "z", "y", "x"], 3) == ["x", "y", "z"]


def test_k_too_large():
    assert top_k_frequent([1, 1, 2], 10) == [1, 2]


def test_zero_and_negative():
    assert top_k_frequent([1, 2], 0) == []
    with pytest.raises(ValueError):
        top_k_frequent([1], -1)


def test_frequency_wins_over_order():
    assert top_k_frequent([3, 1, 1, 2, 2, 2], 2) == [2, 1]


def test_empty():
    assert top_k_frequent([], 3) == []
''',
    reference='''def top_k_frequent(items: list, k: int) -> list:
    if k < 0:
        raise ValueError("k must be >= 0")
    counts: dict = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    # dicts keep insertion (first occurrence) order and sorted() is stable.
    return sorted(counts, key=lambda item: -counts[item])[:k]
''',
)

TASKS = (CHUNKED, FLATTEN, MERGE_INTERVALS, ROTATE, GROUP_ANAGRAMS, TOP_K)
