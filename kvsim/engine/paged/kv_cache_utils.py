"""A block's identity for prefix caching, one for every paged allocator and group: `request_block_keys`, a
request's exact structural keys (`Sequence.block_keys`, what a replay gives) or, for a request given only token
ids, their chained hashes as vLLM 0.33.0's `kv_cache_utils.hash_block_tokens` takes them (block j's hash of its
parent's hash and its token ids, so one key names the whole prefix up to the block's end)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvsim.engine.paged.prefix_table import key_runs

if TYPE_CHECKING:
    from kvsim.engine.sequence import Sequence

ROOT_HASH = 0x6B7673696D  # parent hash of a request's first block (vLLM's NONE_HASH)


def block_token_bytes(token_ids: np.ndarray, num_tokens: int, block_size: int) -> list[bytes]:
    """The token ids of the full blocks within the first `num_tokens`, as int64 bytes, one object per block:
    what a block's hash is taken of. One C call cuts them all (a void-dtype view's tolist)."""
    end = num_tokens // block_size * block_size
    ids = np.ascontiguousarray(token_ids[:end], dtype=np.int64)  # (end,)
    return ids.view(np.dtype((np.void, block_size * 8))).tolist()  # end // block_size bytes objects


def chain_block_hashes(hashes: list[int], token_blocks: list[bytes]) -> list[int]:
    """`hashes` (of the leading blocks) extended in place to every block of `token_blocks`:
    hash((parent hash, block bytes)), the first block's parent `ROOT_HASH`."""
    h = hashes[-1] if hashes else ROOT_HASH
    append = hashes.append
    for chunk in token_blocks[len(hashes) :]:
        h = hash((h, chunk))
        append(h)
    return hashes


def block_hashes(token_ids: np.ndarray, num_tokens: int, block_size: int) -> list[int]:
    """Chained hashes of the full blocks within the first `num_tokens` of `token_ids`."""
    return chain_block_hashes([], block_token_bytes(token_ids, num_tokens, block_size))


class RequestBlockKeys:
    """The cache keys of every full block of a request's final tokens: its exact `block_keys` where it has them (a
    replay's requests), else the chained hashes of its token ids; as an int64 array with its runs of consecutive
    keys (`prefix_table.key_runs`, what the prefix table is walked by), or as a list.

    Keys are made once per admission: a request refused at admission is retried every step, so the last
    request keyed keeps its keys (`get`) until `forget`.
    """

    __slots__ = ("block_size", "_last")

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._last: list | None = None  # [seq, its token ids, (keys, runs), keys as a list or None]

    @staticmethod
    def has_keys(seq: Sequence) -> bool:
        """Whether `seq` can be keyed (it has exact keys or token ids)."""
        return seq.block_keys is not None or seq.token_ids is not None

    def get(self, seq: Sequence) -> tuple[np.ndarray, list[int]]:
        """`seq`'s keys, (full blocks,) int64, and where their runs start (`key_runs`)."""
        return self._entry(seq)[2]

    def get_list(self, seq: Sequence) -> list[int]:
        """`seq`'s keys as a list."""
        last = self._entry(seq)
        if last[3] is None:
            last[3] = last[2][0].tolist()
        return last[3]

    def _entry(self, seq: Sequence) -> list:
        last = self._last
        if last is not None and last[0] is seq and last[1] is seq.token_ids:
            return last
        if seq.block_keys is not None:  # (full blocks,) int64 keys and their runs
            self._last = last = [seq, seq.token_ids, seq.block_keys(self.block_size, seq.num_final_tokens), None]
            return last
        chained = block_hashes(seq.token_ids, seq.num_final_tokens, self.block_size)
        array = np.array(chained, dtype=np.int64)
        self._last = last = [seq, seq.token_ids, (array, key_runs(array)), chained]
        return last

    def forget(self) -> None:
        """The last request keyed was admitted: its keys now live with it."""
        self._last = None


def segment_tail_mask(start_block: int, end_block: int, per_segment: int, need: int) -> list[bool] | None:
    """Which of blocks `start_block`..`end_block - 1` are among the `need` blocks before a boundary every
    `per_segment` blocks (a sliding window's tail a hit at that boundary reads); None when the tails cover every
    block (`need >= per_segment`). Shared by the sliding-window manager's retention and the CPU tier's stores."""
    if need >= per_segment:
        return None
    first = per_segment - need
    return [i % per_segment >= first for i in range(start_block, end_block)]
