"""Swap space for `KVCache`: a preempted request's K/V copied to a CPU tensor (pinned on CUDA) and back."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SwapHandle:
    """Swapped-out KV: kv is [2, L, n, H, D] on the CPU (pinned when the pool is on CUDA).

    On CUDA the device-to-host copy is asynchronous: `swap_in` is stream-ordered after it, but host code that
    reads `kv` directly must `torch.cuda.synchronize()` first.
    """

    kv: torch.Tensor
    num_tokens: int
    num_dropped: int = 0  # leading positions whose blocks a sliding window had freed: zeros here, not KV


class CacheSwaps:
    """`KVCache`'s swap-out and swap-in (mixed into it; its `__init__` sets the slot view and timer used here)."""

    def swap_out(self, slots: np.ndarray) -> SwapHandle | None:
        """Copy the KV at `slots` (all materialised layers) to the CPU: a real copy, timed as "swap".

        A slot of -1 (a position whose block a sliding window freed) holds nothing: its row is zeros.
        """
        if not self.enabled:
            return None
        slots = np.asarray(slots, dtype=np.int64)
        gone = np.flatnonzero(slots < 0)
        index = self._index(np.maximum(slots, 0))
        shape = (2, self.num_layers, len(index), self.spec.num_kv_heads, self.spec.head_dim)
        on_cuda = self.device.type == "cuda"
        host = torch.empty(shape, dtype=self.dtype, pin_memory=on_cuda)
        with self.timer.measure("swap"):
            host_rows = host.view(self._bits).view(2 * self.num_layers, len(index), -1)  # [2L, n, H*D]
            if on_cuda:
                rows = self._slot_rows.index_select(1, index)
                if len(gone):
                    rows[:, self._index(gone)] = 0
                host_rows.copy_(rows, non_blocking=True)
            else:
                torch.index_select(self._slot_rows, 1, index, out=host_rows)
                host_rows[:, torch.from_numpy(gone)] = 0
        held = slots >= 0
        num_dropped = int(np.argmax(held)) if held.any() else len(slots)  # leading slots a window freed
        return SwapHandle(host, len(index), num_dropped)

    def swap_in(self, handle: SwapHandle | None, slots: np.ndarray) -> None:
        """Copy a swapped-out request back into `slots` (any slots, one per swapped token; -1: skipped), timed
        as "swap"."""
        if not self.enabled or handle is None:
            return
        assert len(slots) == handle.num_tokens, (len(slots), handle.num_tokens)
        slots = np.asarray(slots, dtype=np.int64)
        held = np.flatnonzero(slots >= 0)
        index = self._index(slots[held])
        with self.timer.measure("swap"):
            rows = handle.kv.view(self._bits).view(2 * self.num_layers, len(slots), -1)  # [2L, n, H*D]
            # Copy first, select after: on CUDA the swap-out's device-to-host copy into handle.kv may still be
            # in flight, so the host must not read it; the copy back is ordered after it on the stream.
            rows = rows.to(self.device, non_blocking=True)
            if len(held) < len(slots):
                rows = rows.index_select(1, self._index(held))
            self._slot_rows.index_copy_(1, index, rows)
