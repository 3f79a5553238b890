"""The read path of `KVCache`: paged and flat gathers into one padded batch, integrity checks, decode attention."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvsim.engine.tensors import kernels


@dataclass(frozen=True)
class KVRead:
    """What a batched read returns: every sequence's K/V padded to the longest, and the true lengths.

    kv: [2, L, B, T, H, D] (K = kv[0], V = kv[1]); seq_lens: (B,) int64 on the cache's device.
    """

    kv: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def k(self) -> torch.Tensor:  # [L, B, T, H, D]
        return self.kv[0]

    @property
    def v(self) -> torch.Tensor:  # [L, B, T, H, D]
        return self.kv[1]


class CacheReads:
    """`KVCache`'s reads (mixed into it; its `__init__` sets the views, buffers and timer used here).

    Reads gather into one reusable buffer, so a `KVRead` is valid until the next read.
    """

    def _read_out(self, numel: int) -> torch.Tensor:
        """A contiguous (numel,) slice of the reusable read buffer, grown by doubling.

        Reads gather into it instead of a fresh tensor: on a CPU a fresh 100 MiB tensor per read is a fresh
        mmap whose page faults cost more than the gather. So a `KVRead` is valid until the next read.
        """
        buf = self._read_buf
        if buf is None or buf.numel() < numel:
            cap = max(numel, 2 * buf.numel() if buf is not None else 0)
            buf = self._read_buf = torch.empty(cap, dtype=self._bits, device=self.device)
        return buf[:numel]

    def read_paged(
        self, block_tables: list[np.ndarray], seq_lens: list[int], seq_ids: list[int] | None = None
    ) -> KVRead | None:
        """Gather each sequence's first seq_lens[b] tokens through its block table: one gather, timed "read".

        Tables are padded to the longest sequence (with block 0; masked by `seq_lens`). With integrity on and
        `seq_ids` given, every token read is checked. None when accounting only or the batch is empty.
        """
        if not self.enabled or not seq_lens:
            return None
        lens = np.asarray(seq_lens, dtype=np.int64)
        assert lens.min() >= 1
        table = kernels.pad_block_tables(block_tables, lens, self.block_size)  # (B, M)
        bt = self._index(table)
        s = self.spec
        out = self._read_out(2 * self.num_layers * table.size * self.block_size * s.num_kv_heads * s.head_dim)
        with self.timer.measure("read"):
            kv = kernels.gather_paged(self._cache_bits, bt, out).view(self.dtype)  # [2, L, B, M*block_size, H, D]
        read = KVRead(kv, self._index(lens))
        if self.integrity and seq_ids is not None:
            self._check_read(read, lens, seq_ids)
        return read

    def read_flat(self, starts: list[int], seq_lens: list[int], seq_ids: list[int] | None = None) -> KVRead | None:
        """Read each sequence's contiguous slab [start, start + len): one gather of contiguous runs, timed "read".

        Same return and integrity checks as `read_paged`.
        """
        if not self.enabled or not seq_lens:
            return None
        lens = np.asarray(seq_lens, dtype=np.int64)
        st = np.asarray(starts, dtype=np.int64)
        assert lens.min() >= 1 and st.min() >= 0 and (st + lens).max() <= self.num_slots
        st_t, lens_t = self._index(st), self._index(lens)
        s = self.spec
        out = self._read_out(2 * self.num_layers * len(lens) * int(lens.max()) * s.num_kv_heads * s.head_dim)
        with self.timer.measure("read"):
            kv = kernels.gather_runs(self._flat_bits, st_t, lens_t, int(lens.max()), out)  # [2, L, B, T, H, D]
        kv = kv.view(self.dtype)
        read = KVRead(kv, lens_t)
        if self.integrity and seq_ids is not None:
            self._check_read(read, lens, seq_ids)
        return read

    def _check_read(self, read: KVRead, lens: np.ndarray, seq_ids: list[int]) -> None:
        t = read.kv.shape[3]
        valid = torch.arange(t, device=self.device)[None, :] < read.seq_lens[:, None]  # (B, T)
        got = read.kv[:, :, valid]  # [2, L, sum(lens), H, D], sequence-major like the arrays below
        ids = np.repeat(np.asarray(seq_ids, dtype=np.int64), lens)
        pos = np.arange(lens.sum()) - np.repeat(np.cumsum(lens) - lens, lens)
        self.patterns.check(got, ids, pos, lambda n: "read")

    def verify(self, seq_id: int, slots: np.ndarray, positions: np.ndarray) -> None:
        """Integrity mode: assert the pool at `slots` holds what `seq_id`'s tokens at `positions` wrote.

        Raises AssertionError naming the first mismatch; a no-op without integrity or materialised layers.
        Slots of -1 (positions a sliding window freed) are skipped.
        """
        if not (self.enabled and self.integrity) or len(slots) == 0:
            return
        slots = np.asarray(slots, dtype=np.int64)
        if slots.min() < 0:  # positions a sliding window freed: nothing to check there
            held = slots >= 0
            slots, positions = slots[held], np.asarray(positions)[held]
            if len(slots) == 0:
                return
        got = self._slot_rows.index_select(1, self._index(slots))  # [2L, N, H*D]
        got = got.view(2, self.num_layers, len(slots), self.spec.num_kv_heads, self.spec.head_dim)
        ids = np.full(len(slots), seq_id, dtype=np.int64)
        self.patterns.check(got, ids, np.asarray(positions, dtype=np.int64), lambda n: f"slot {int(slots[n])}")

    def decode_attention(self, read: KVRead | None, q: torch.Tensor | None = None) -> torch.Tensor | None:
        """SDPA of one query token per sequence and layer over what `read` gathered, timed "attention".

        q: [L, B, Hq, D] (default: a random query in the compute dtype). Returns [L, B, Hq, D], or None when
        accounting only. fp8/int8 pools are read as bf16 (unit scale).
        """
        if read is None:
            return None
        num_layers, b, t, h, d = read.k.shape
        compute = self.dtype if self.dtype in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
        if q is None:
            q = torch.randn((num_layers, b, self.num_q_heads, d), generator=self._gen, device=self.device).to(compute)
        lens = read.seq_lens.repeat(num_layers)  # (L*B,)
        with self.timer.measure("attention"):
            out = kernels.decode_attention(q.flatten(0, 1), read.k.flatten(0, 1), read.v.flatten(0, 1), lens)
        return out.view(num_layers, b, -1, d)
