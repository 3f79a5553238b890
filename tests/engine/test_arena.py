"""The slot arena: placement policies, coalescing, buddy split/merge, and invariants against a bitmap model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsim.engine.flat.arena import PLACEMENTS, Arena


def fill(arena: Arena, sizes: list[int]) -> list[int]:
    starts = [arena.alloc(n) for n in sizes]
    assert None not in starts
    return starts


# --- first-fit / best-fit -------------------------------------------------------------------------------


def test_first_fit_takes_lowest_hole_best_fit_smallest():
    # layout after freeing b and d:  a[0,10) hole[10,30) c[30,35) hole[35,43) e[43,50) hole[50,60)
    for placement, expected in (("first-fit", 10), ("best-fit", 35)):
        arena = Arena(60, placement)
        a, b, c, d, e = fill(arena, [10, 20, 5, 8, 7])
        assert (a, b, c, d, e) == (0, 10, 30, 35, 43)
        arena.release(b)
        arena.release(d)
        assert arena.holes() == [(10, 20), (35, 8), (50, 10)]
        assert arena.alloc(6) == expected


def test_best_fit_breaks_ties_by_lowest_address():
    arena = Arena(30, "best-fit")
    s = fill(arena, [4, 1, 4, 1, 4, 16])
    arena.release(s[4])
    arena.release(s[0])
    assert arena.alloc(3) == 0


def test_release_coalesces_both_neighbours():
    arena = Arena(30)
    a, b, c = fill(arena, [10, 10, 10])
    arena.release(a)
    arena.release(c)
    assert arena.holes() == [(0, 10), (20, 10)]
    arena.release(b)
    assert arena.holes() == [(0, 30)]
    assert arena.free_total == 30 and arena.used_total == 0 and arena.largest_free_extent == 30


def test_external_fragmentation_refuses_what_the_free_total_would_fit():
    arena = Arena(40)
    s = fill(arena, [10, 10, 10, 10])
    arena.release(s[0])
    arena.release(s[2])
    assert arena.free_total == 20 and arena.largest_free_extent == 10
    assert not arena.can_fit(15)
    assert arena.alloc(15) is None
    assert arena.holes() == [(0, 10), (20, 10)]  # a refused alloc changes nothing


def test_empty_arena_fits_nothing():
    for placement in PLACEMENTS:
        arena = Arena(0, placement)
        assert arena.alloc(1) is None and arena.largest_free_extent == 0 and arena.max_extent == 0


# --- buddy ----------------------------------------------------------------------------------------------


def test_buddy_regions_cover_every_slot():
    arena = Arena(100, "buddy")
    assert arena.holes() == [(0, 64), (64, 32), (96, 4)]
    assert arena.max_extent == 64 and arena.free_total == 100


def test_buddy_rounds_up_splits_smallest_block_and_merges_back():
    arena = Arena(100, "buddy")
    assert arena.footprint(3) == 4 and arena.footprint(4) == 4 and arena.footprint(5) == 8
    assert arena.alloc(3) == 96  # the 4-slot region is the smallest block that fits
    assert arena.extent(96) == 4
    assert arena.alloc(5) == 64  # splits 64+32 -> 64+8, leaves 72+8 and 80+16
    assert arena.holes() == [(0, 64), (72, 8), (80, 16)]
    assert arena.used_total == 12
    assert arena.alloc(40) == 0
    assert arena.alloc(33) is None  # 28 free in blocks of 16, 8, ... but no 64 block
    arena.release(64)
    assert arena.holes() == [(64, 32)]  # 64+8 merged with 72+8, then with 80+16
    assert arena.alloc(64) is None  # regions never merge with each other


def test_buddy_does_not_merge_adjacent_non_buddies():
    arena = Arena(64, "buddy")
    s = fill(arena, [16, 16, 16, 16])
    arena.release(s[1])
    arena.release(s[2])  # [16,32) and [32,48) are adjacent but not buddies
    assert arena.holes() == [(16, 16), (32, 16)]
    assert arena.free_total == 32 and not arena.can_fit(32)
    arena.release(s[0])
    assert arena.holes() == [(0, 32), (32, 16)]


# --- invariants under random operations -----------------------------------------------------------------


def check_against_bitmap(arena: Arena, used: dict[int, int]) -> None:
    """Extents are disjoint, holes are exactly the free slots, and the queries agree with the holes."""
    owner = np.zeros(arena.num_slots, dtype=np.int64)
    for start, size in used.items():
        assert arena.extent(start) == arena.footprint(size)
        owner[start : start + arena.footprint(size)] += 1
    assert owner.max(initial=0) <= 1
    free = np.zeros(arena.num_slots, dtype=np.int64)
    holes = arena.holes()
    for start, size in holes:
        assert 0 <= start and start + size <= arena.num_slots
        free[start : start + size] += 1
    assert np.array_equal(free + owner, np.ones(arena.num_slots, dtype=np.int64))
    assert arena.free_total == int(free.sum())
    assert arena.largest_free_extent == max((size for _, size in holes), default=0)
    if arena.placement == "buddy":
        for start, size in holes + [(s, arena.extent(s)) for s in used]:
            assert size & (size - 1) == 0 and start % size == 0
    else:
        for (s1, n1), (s2, _) in zip(holes, holes[1:]):
            assert s1 + n1 < s2  # maximal: neighbours always coalesce


@pytest.mark.parametrize("placement", PLACEMENTS)
@settings(max_examples=150, deadline=None)
@given(
    num_slots=st.integers(1, 80),
    ops=st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.integers(0, 1000)), max_size=30),
)
def test_random_ops_keep_invariants(placement, num_slots, ops):
    arena = Arena(num_slots, placement)
    used: dict[int, int] = {}
    for do_alloc, size, pick in ops:
        if do_alloc or not used:
            holes = arena.holes()
            fits = [(s, n) for s, n in holes if n >= arena.footprint(size)]
            start = arena.alloc(size)
            if not fits:
                assert start is None
                continue
            if placement == "first-fit":
                assert start == fits[0][0]
            elif placement == "best-fit":
                assert start == min(fits, key=lambda h: (h[1], h[0]))[0]
            else:
                assert start == min(fits, key=lambda h: (h[1], h[0]))[0]  # smallest block, lowest address
            used[start] = size
        else:
            start = sorted(used)[pick % len(used)]
            arena.release(start)
            del used[start]
        check_against_bitmap(arena, used)
    for start in list(used):
        arena.release(start)
    assert arena.free_total == num_slots and arena.used_total == 0
    assert len(arena.holes()) == (1 if placement != "buddy" else bin(num_slots).count("1"))
