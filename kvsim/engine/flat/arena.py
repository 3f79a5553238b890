"""A contiguous address-space allocator over token slots: the flat baselines place their slabs with it.

Holes form as slabs come and go, so external fragmentation is real: a request can be refused while the free
total would fit it. Placement is first-fit (default), best-fit or buddy.
"""

from __future__ import annotations

from bisect import bisect_left, insort

from typing import Literal

Placement = Literal["first-fit", "best-fit", "buddy"]
PLACEMENTS: tuple[str, ...] = ("first-fit", "best-fit", "buddy")


def _ceil_log2(n: int) -> int:
    """Smallest k with 2**k >= n (n >= 1)."""
    return (n - 1).bit_length()


class Arena:
    """Extents of `[0, num_slots)` handed out by `alloc(n) -> start` and returned by `release(start)`.

    First-fit and best-fit keep the holes as maximal free ranges; a freed extent coalesces with the holes on
    either side. Hole starts are kept sorted (first-fit scans them in address order) and `(size, start)` pairs
    too (best-fit bisects them; the largest hole is the last one):

        slots   0        8            20     24          32
                [ slab A ][   hole   ][slab B][   hole   ]      holes: {8: 12, 24: 8}

    Buddy splits the arena into maximal power-of-two *regions* (100 slots -> 64 + 32 + 4 at offsets 0, 64, 96),
    so no slot is lost; each region is a buddy tree. A request of n slots takes a block of 2**ceil(log2 n)
    slots (the rounding is the caller's internal fragmentation), split from the smallest free block that fits,
    and a freed block merges with its buddy (`start ^ size`) while both are free and inside one region. Region
    offsets are multiples of their sizes, so the xor rule holds arena-wide. The largest request buddy can ever
    place is the largest region.

    Every query is O(1) or O(log n) except first-fit's scan over the holes (one per live slab at most).
    """

    def __init__(self, num_slots: int, placement: Placement = "first-fit"):
        assert num_slots >= 0
        assert placement in PLACEMENTS, placement
        self.num_slots = num_slots
        self.placement = placement
        self.used_total = 0  # slots held by live extents (buddy: whole blocks)
        self._used: dict[int, int] = {}  # start -> slots held
        if placement == "buddy":
            self._init_buddy()
        else:
            self._starts: list[int] = []  # hole starts, ascending
            self._hole_at: dict[int, int] = {}  # hole start -> size
            self._hole_ending: dict[int, int] = {}  # hole end -> start
            self._by_size: list[tuple[int, int]] = []  # (size, start), ascending
            if num_slots:
                self._add_hole(0, num_slots)

    # --- queries ------------------------------------------------------------------------------------

    @property
    def free_total(self) -> int:
        """Free slots, wherever they are."""
        return self.num_slots - self.used_total

    @property
    def largest_free_extent(self) -> int:
        """The largest n for which `alloc(n)` succeeds now (buddy: the largest free block)."""
        if self.placement == "buddy":
            for order in range(len(self._free) - 1, -1, -1):
                if self._free[order]:
                    return 1 << order
            return 0
        return self._by_size[-1][0] if self._by_size else 0

    @property
    def max_extent(self) -> int:
        """The largest n `alloc(n)` could ever place, on an empty arena (buddy: the largest region)."""
        if self.placement == "buddy":
            return 1 << self._regions[0][1] if self._regions else 0
        return self.num_slots

    def footprint(self, n: int) -> int:
        """Slots an extent of `n` actually takes: n, or the buddy block 2**ceil(log2 n)."""
        return 1 << _ceil_log2(n) if self.placement == "buddy" else n

    def can_fit(self, n: int) -> bool:
        """Whether `alloc(n)` would succeed now."""
        return self.footprint(n) <= self.largest_free_extent

    def extent(self, start: int) -> int:
        """Slots held by the live extent at `start`."""
        return self._used[start]

    def holes(self) -> list[tuple[int, int]]:
        """Free ranges as (start, size) in address order (buddy: free blocks, adjacent ones not merged)."""
        if self.placement == "buddy":
            return sorted((s, 1 << k) for s, k in self._free_order.items())
        return [(s, self._hole_at[s]) for s in self._starts]

    # --- alloc / release ----------------------------------------------------------------------------

    def alloc(self, n: int) -> int | None:
        """Place an extent of `n` slots; its start, or None when no hole is large enough."""
        assert n > 0
        if self.placement == "buddy":
            return self._alloc_buddy(n)
        if n > self.largest_free_extent:
            return None
        if self.placement == "best-fit":
            size, start = self._by_size[bisect_left(self._by_size, (n, -1))]
        else:
            start = next(s for s in self._starts if self._hole_at[s] >= n)
            size = self._hole_at[start]
        self._remove_hole(start, size)
        if size > n:
            self._add_hole(start + n, size - n)
        self._used[start] = n
        self.used_total += n
        return start

    def release(self, start: int) -> None:
        """Return the extent at `start`; it coalesces with free neighbours."""
        size = self._used.pop(start)
        self.used_total -= size
        if self.placement == "buddy":
            self._release_buddy(start, _ceil_log2(size))
            return
        end = start + size
        right = self._hole_at.get(end)
        if right is not None:
            self._remove_hole(end, right)
            end += right
        left = self._hole_ending.get(start)
        if left is not None:
            self._remove_hole(left, start - left)
            start = left
        self._add_hole(start, end - start)

    # --- holes (first-fit, best-fit) ----------------------------------------------------------------

    def _add_hole(self, start: int, size: int) -> None:
        insort(self._starts, start)
        self._hole_at[start] = size
        self._hole_ending[start + size] = start
        insort(self._by_size, (size, start))

    def _remove_hole(self, start: int, size: int) -> None:
        del self._starts[bisect_left(self._starts, start)]
        del self._hole_at[start]
        del self._hole_ending[start + size]
        del self._by_size[bisect_left(self._by_size, (size, start))]

    # --- buddy --------------------------------------------------------------------------------------

    def _init_buddy(self) -> None:
        top = max(self.num_slots.bit_length(), 1)
        self._free: list[list[int]] = [[] for _ in range(top)]  # order -> free block starts, ascending
        self._free_order: dict[int, int] = {}  # free block start -> order
        self._regions: list[tuple[int, int]] = []  # (start, order), largest first
        offset = 0
        for order in range(top - 1, -1, -1):
            if self.num_slots >> order & 1:
                self._regions.append((offset, order))
                self._push_free(offset, order)
                offset += 1 << order
        self._region_starts = [s for s, _ in self._regions]

    def _push_free(self, start: int, order: int) -> None:
        insort(self._free[order], start)
        self._free_order[start] = order

    def _pop_free(self, start: int, order: int) -> None:
        blocks = self._free[order]
        del blocks[bisect_left(blocks, start)]
        del self._free_order[start]

    def _alloc_buddy(self, n: int) -> int | None:
        want = _ceil_log2(n)
        order = next((k for k in range(want, len(self._free)) if self._free[k]), None)
        if order is None:
            return None
        start = self._free[order][0]  # lowest address among the smallest blocks that fit
        self._pop_free(start, order)
        while order > want:  # split, keeping the lower half
            order -= 1
            self._push_free(start + (1 << order), order)
        self._used[start] = 1 << want
        self.used_total += 1 << want
        return start

    def _release_buddy(self, start: int, order: int) -> None:
        region_order = self._regions[bisect_left(self._region_starts, start + 1) - 1][1]
        while order < region_order:
            buddy = start ^ (1 << order)
            if self._free_order.get(buddy) != order:
                break
            self._pop_free(buddy, order)
            start = min(start, buddy)
            order += 1
        self._push_free(start, order)
