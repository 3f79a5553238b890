"""Offload keys (a block hash and its KV cache group) and the per-request context the manager is called with."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T")

# An offloaded chunk's name: its block hash, then its group index in 4 big-endian bytes (vLLM's
# `make_offload_key`: bytes, not a tuple, so keys compare and hash as vLLM's do).
OffloadKey = bytes


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """`make_offload_key`: the key of a chunk whose last block has `block_hash`, in group `group_idx`."""
    return block_hash + group_idx.to_bytes(4, "big", signed=False)


def offload_group_idx(key: OffloadKey) -> int:
    """`get_offload_group_idx`: the group a key belongs to."""
    return int.from_bytes(key[-4:], "big", signed=False)


@dataclass
class ReqContext:
    """One request as the manager sees it (vLLM's `ReqContext`): its id, the end-token position of each key it
    used (so the policies can order its keys head to tail), and per-owner scratch state."""

    req_id: str
    _state: dict[type, Any] = field(default_factory=dict, repr=False)
    _positions: dict[OffloadKey, int] = field(default_factory=dict, repr=False)

    def set_state(self, value: Any) -> None:
        self._state[type(value)] = value

    def get_state(self, cls: type[_T]) -> _T | None:
        return self._state.get(cls)

    def set_offload_key_position(self, key: OffloadKey, end_token: int) -> None:
        self._positions[key] = end_token

    def get_offload_key_position(self, key: OffloadKey) -> int | None:
        return self._positions.get(key)
