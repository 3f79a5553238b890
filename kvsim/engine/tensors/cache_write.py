"""The write path of `KVCache`: new tokens' K/V scattered into their slots, one timed scatter per step."""

from __future__ import annotations

import numpy as np
import torch

from kvsim.engine.tensors import kernels
from kvsim.errors import KvsimError


class CacheWrites:
    """`KVCache`'s writes (mixed into it; its `__init__` sets the views, generator and timer used here).

    The write kernel is picked once per cache; stand-in K/V comes from a random buffer grown by doubling, or,
    in integrity mode, from each token's bit patterns.
    """

    def _pick_write_kernel(self, name: str) -> str:
        if name == "auto":  # on a CPU numpy's row copies moved ~2x the bytes/s of torch's index_put_ (kernels.scatter_rows)
            if self.device.type == "cpu":
                return "rows"
            return "triton" if kernels.HAS_TRITON else "index_copy"
        if name not in kernels.WRITE_KERNELS:
            choices = ", ".join(kernels.WRITE_KERNELS)
            raise KvsimError(f"unknown write kernel {name!r} (choose auto, {choices})", field="write_kernel")
        if name == "triton" and (self.device.type != "cuda" or not kernels.HAS_TRITON):
            raise KvsimError("the triton write kernel needs a CUDA device and triton installed", field="write_kernel")
        if name == "rows" and self.device.type != "cpu":
            raise KvsimError("the rows write kernel is numpy's: CPU tensors only", field="write_kernel")
        return name

    def _write_source(self, n: int) -> torch.Tensor:
        """[2, L, n, H, D] stand-in K/V for n new tokens: a slice of a random buffer grown by doubling."""
        if self._src.dim() == 5 and self._src.shape[2] >= n:
            return self._src[:, :, :n]
        cap = max(16, 1 << (n - 1).bit_length())
        # 1024 random tokens, repeated up to the capacity: a prefill of 16k tokens then costs one 64 MiB copy,
        # not 64 MiB of random numbers (~25 ms each time the buffer grows)
        shape = (2, self.num_layers, min(cap, 1024), self.spec.num_kv_heads, self.spec.head_dim)
        if self.dtype == torch.int8:
            src = torch.randint(-127, 128, shape, generator=self._gen, device=self.device, dtype=torch.int8)
        else:
            src = torch.randn(shape, generator=self._gen, device=self.device).to(self.dtype)
        src = src.repeat(1, 1, cap // shape[2], 1, 1)  # [2, L, cap, H, D]
        self._src = src
        self._src_rows = kernels.token_rows(src) if self.device.type == "cpu" else None  # [2L, cap] numpy rows
        return src[:, :, :n]

    def _write_source_rows(self, n: int) -> np.ndarray:
        """The same stand-in K/V as numpy token rows [2L, n] (CPU), for `kernels.scatter_rows`."""
        self._write_source(n)
        return self._src_rows[:, :n]

    def write_steps(self, slots: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray) -> None:
        """k consecutive steps of the same N requests (a decode run): one timed scatter per step.

        slots, positions: (k, N) int arrays, row j for step j; seq_ids: (N,). Step 0 is timed in the timer's
        current step and step j > 0 opens a new one, so kernel times stay per step. Index and source tensors
        are built once for all k steps: only the scatter itself runs per step.
        """
        k, n = slots.shape
        timer = self.timer
        if not self.enabled or n == 0:
            for _ in range(k - 1):
                timer.new_step()
            return
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        assert slots.min() >= 0 and slots.max() < self.num_slots, "slot outside the pool"
        if self.write_kernel == "rows" and not self.integrity:
            self._write_steps_batched(slots)
            return
        index = self._index(slots)  # (k, N)
        rows = self._slot_rows  # [2L, S, H*D]
        if self.integrity:
            ids = np.broadcast_to(np.asarray(seq_ids, dtype=np.int64), (k, n)).reshape(-1)
            vals = self.patterns.expected(ids, np.asarray(positions, dtype=np.int64).reshape(-1))  # [2, L, k*N, H, D]
            sources = [vals[:, :, j * n : (j + 1) * n].reshape(rows.shape[0], n, -1) for j in range(k)]  # [2L, N, H*D]
            kernel = "index_copy"
        else:
            sources = [self._write_source(n).view(self._bits).reshape(rows.shape[0], n, -1)] * k
            kernel = self.write_kernel
        # The kernels' scatters with their views hoisted out of the per-step loop (same ops, same result).
        if kernel == "index_copy":
            scatter = lambda idx, src: rows.index_copy_(1, idx, src)  # noqa: E731
        elif kernel == "index_put":
            slot_major = rows.transpose(0, 1)  # [S, 2L, H*D]
            scatter = lambda idx, src: slot_major.index_put_((idx,), src.transpose(0, 1))  # noqa: E731
        else:
            flat, shape = self._flat_bits, (2, self.num_layers, n, self.spec.num_kv_heads, self.spec.head_dim)
            scatter = lambda idx, src: kernels.scatter_triton(flat, idx, src.view(shape))  # noqa: E731
        measure = timer.measure
        for j in range(k):
            if j:
                timer.new_step()
            with measure("write"):
                scatter(index[j], sources[j])

    def _write_steps_batched(self, slots: np.ndarray) -> None:
        """`write_steps` on a CPU: the k steps' scatters as one row copy, its time shared evenly by the steps.

        Each step writes the same stand-in rows as the per-step path (the source broadcasts over the k steps,
        nothing is copied), so the pool ends up bit for bit the same. A CPU op is synchronous, so one scatter
        of k*N rows moves the bytes of k scatters of N rows and its time splits by steps; what it saves is the
        per-step Python (timer, views, call), most of a replay's CPU time.
        """
        src = self._write_source_rows(slots.shape[1])  # [2L, N]
        with self.timer.measure_steps("write", len(slots)):
            kernels.scatter_rows(self._token_rows, slots, src)

    def write(self, slots: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray) -> None:
        """Store the K/V of N new tokens (all materialised layers) at `slots`: one scatter, timed as "write".

        slots, seq_ids, positions: (N,) int arrays (from the allocators' `slot_mapping`). Without integrity
        the data is random; with it, each token's bit patterns (see `IntegrityPatterns.expected`).
        """
        if not self.enabled or len(slots) == 0:
            return
        slots = np.asarray(slots, dtype=np.int64)
        assert slots.min() >= 0 and slots.max() < self.num_slots, "slot outside the pool"
        if self.integrity:
            vals = self.patterns.expected(np.asarray(seq_ids), np.asarray(positions))
            index = self._index(slots)
            with self.timer.measure("write"):
                kernels.scatter_index_copy(self._flat_bits, index, vals)
            return
        if self.write_kernel == "rows":
            src = self._write_source_rows(len(slots))  # [2L, N]
            with self.timer.measure("write"):
                kernels.scatter_rows(self._token_rows, slots, src)
            return
        src, index = self._write_source(len(slots)), self._index(slots)
        scatter = getattr(kernels, f"scatter_{self.write_kernel}")
        with self.timer.measure("write"):
            scatter(self._flat_bits, index, src.view(self._bits))
