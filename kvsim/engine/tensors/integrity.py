"""Integrity mode's bookkeeping: each request's prefix fingerprints, the token-unique bit patterns they
expand to, and the check that names the first token whose K/V differs from what its request wrote."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from kvsim.engine.tensors import kernels


class IntegrityPatterns:
    """What every token of every request must hold in the pool, derived from its prefix fingerprint.

    A token's value depends on its prefix fingerprint (`register`), layer, K/V side and element, so rewrites
    after preemption, swaps into other slots, and shared prefix blocks all read back exactly what the
    reading request's own tokens would have written. `bits` is the pool's element width (8, 16 or 32).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, bits: int, device: torch.device):
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.bits = bits
        self.device = device
        self._fingerprints: dict[int, np.ndarray] = {}
        self._lanes: torch.Tensor | None = None  # [2, L, H * D] integrity patterns, made on first use

    def register(self, seq_id: int, token_ids: np.ndarray) -> None:
        """Remember the prefix fingerprints of `seq_id`'s token ids (prompt + output)."""
        self._fingerprints[seq_id] = kernels.prefix_fingerprints(token_ids)

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's fingerprints (its blocks may stay cached for others)."""
        self._fingerprints.pop(seq_id, None)

    def _token_fingerprints(self, seq_ids: np.ndarray, positions: np.ndarray, groups=None) -> torch.Tensor:
        """(N,) int64 on the device: the fingerprint of each (seq_id, position), salted by its KV cache group (a
        mixed model's groups are other layers: their K/V of a token differ; group 0 unsalted)."""
        out = np.empty(len(positions), dtype=np.uint64)
        for seq_id in np.unique(seq_ids):  # one vectorised lookup per request
            rows = seq_ids == seq_id
            table = self._fingerprints.get(int(seq_id))
            if table is None:
                out[rows] = kernels.seq_fingerprints(int(seq_id), positions[rows])
            else:
                out[rows] = table[positions[rows]]
        if groups is not None:
            out ^= np.asarray(groups, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        return torch.from_numpy(out.view(np.int64)).to(self.device)

    def expected(self, seq_ids: np.ndarray, positions: np.ndarray, groups=None) -> torch.Tensor:
        """[2, L, N, H, D] in the pool's integer view: what those tokens must hold (in their `groups`' blocks: an
        (N,) int array, or None for group 0)."""
        fp = self._token_fingerprints(seq_ids, positions, groups)
        if self._lanes is None:
            self._lanes = kernels.integrity_lanes(self.num_layers, self.num_kv_heads * self.head_dim, self.bits, self.device)
        vals = kernels.integrity_values(fp, self._lanes)  # [2, L, N, H * D]
        return vals.view(2, self.num_layers, len(positions), self.num_kv_heads, self.head_dim)

    def check(self, got: torch.Tensor, seq_ids: np.ndarray, positions: np.ndarray, where: Callable[[int], str],
              groups=None):
        """Raise AssertionError naming the first token of `got` ([2, L, N, H, D], float) that differs."""
        expected = self.expected(seq_ids, positions, groups)
        got_bits = got.contiguous().view(expected.dtype)  # the same-width integer view
        bad = (got_bits != expected).flatten(3).any(dim=3)  # [2, L, N]
        bad_tokens = bad.any(dim=1).any(dim=0)  # (N,)
        if not bool(bad_tokens.any()):
            return
        n = int(bad_tokens.nonzero()[0, 0])
        kv, layer = (int(i) for i in bad[:, :, n].nonzero()[0])
        raise AssertionError(
            f"integrity: seq {int(seq_ids[n])} position {int(positions[n])} ({where(n)}) layer {layer} "
            f"{'KV'[kv]} does not hold what that request's tokens wrote"
        )
