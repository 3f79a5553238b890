"""The real K/V pool: one torch tensor indexed by the allocators' slots, with timed writes, reads and swaps.

Byte accounting belongs to the allocators; this tensor only makes the memory traffic real. Materialise fewer
layers (or none: every method becomes a no-op) without changing any byte figure.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvsim.engine.tensors import kernels
from kvsim.engine.tensors.device import TORCH_DTYPES, free_memory_bytes, resolve_device, zeros_pool
from kvsim.engine.tensors.integrity import IntegrityPatterns
from kvsim.size.kv_cache_spec import KVCacheSpec
from kvsim.engine.tensors.timing import StepTimer
from kvsim.errors import KvsimError
from kvsim.units import format_bytes

_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32}  # same-width integer view: copies and gathers move bits, never convert


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

@dataclass(frozen=True)
class SwapHandle:
    """Swapped-out KV: kv is [2, L, n, H, D] on the CPU (pinned when the pool is on CUDA).

    On CUDA the device-to-host copy is asynchronous: `swap_in` is stream-ordered after it, but host code that
    reads `kv` directly must `torch.cuda.synchronize()` first.
    """

    kv: torch.Tensor
    num_tokens: int
    num_dropped: int = 0  # leading positions whose blocks a sliding window had freed: zeros here, not KV


class KVCache:
    """The K/V pool of `num_slots` token slots over `num_layers` materialised layers (nano-vllm layout).

        kv_cache [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
        kv_flat  [2, num_layers, num_blocks * block_size, num_kv_heads, head_dim]   (same memory)

    `num_blocks = ceil(num_slots / block_size)`, so a flat arena whose slot count is not a multiple of the
    block size fits too. Every write/read/swap is timed into `timer` (µs per step and kind).

    Integrity mode writes token-unique bit patterns instead of random data and checks reads and `verify`
    against them (`patterns`, an `IntegrityPatterns`: the values follow each token's prefix fingerprint).

    Reads gather into one reusable buffer, so a `KVRead` is valid until the next read. The write kernel is
    picked once per cache; stand-in K/V comes from a random buffer grown by doubling, or, in integrity mode,
    from each token's bit patterns.
    """

    def __init__(
        self,
        spec: KVCacheSpec,
        num_slots: int,
        *,
        device: str = "auto",
        num_layers: int = 1,
        integrity: bool = False,
        num_q_heads: int | None = None,
        write_kernel: str = "auto",
        seed: int = 0,
    ):
        if spec.dtype not in TORCH_DTYPES:
            raise KvsimError(f"kv dtype {spec.dtype!r} has no torch tensor type here", field="dtype")
        if num_layers < 0:
            raise KvsimError(f"materialised layers must be >= 0, got {num_layers}", field="num_layers")
        assert num_slots > 0
        self.spec = spec
        self.num_slots = num_slots
        self.block_size = spec.block_size
        self.num_blocks = -(-num_slots // spec.block_size)
        self.num_layers = num_layers
        self.integrity = integrity
        self.device = resolve_device(device)
        self.dtype = TORCH_DTYPES[spec.dtype]
        self.num_q_heads = num_q_heads or spec.num_kv_heads
        self.timer = StepTimer(self.device, enabled=num_layers > 0)
        bits = 8 * torch.empty(0, dtype=self.dtype).element_size()
        self.patterns = IntegrityPatterns(num_layers, spec.num_kv_heads, spec.head_dim, bits, self.device)
        self._src = torch.empty(0)  # [2, L, cap, H, D] write data, grown on demand
        self._src_rows: np.ndarray | None = None  # the same buffer as numpy token rows [2L, cap] (CPU)
        self._read_buf: torch.Tensor | None = None  # (cap,) integer elements that reads gather into
        self._gen = torch.Generator(device=self.device).manual_seed(seed)
        self.write_kernel = self._pick_write_kernel(write_kernel)
        self.kv_cache: torch.Tensor | None = None
        self.kv_flat: torch.Tensor | None = None
        if num_layers == 0:
            return
        free = free_memory_bytes(self.device)
        if self.nbytes > free:
            raise KvsimError(
                f"the KV pool needs {format_bytes(self.nbytes)} ({num_layers} layers x {self.num_blocks} blocks x "
                f"{spec.block_size} tokens x {spec.num_kv_heads} heads x {spec.head_dim} x K/V, {spec.dtype}) but "
                f"{self.device.type} has {format_bytes(free)} free; materialise fewer layers (--layers) or none "
                "(--no-tensors)",
                field="num_layers",
            )
        shape = (2, num_layers, self.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
        # zeros, not empty: padded reads touch unwritten slots, and garbage NaNs would poison masked attention
        self.kv_cache = zeros_pool(shape, self.dtype, self.device)
        self.kv_flat = self.kv_cache.view(2, num_layers, self.num_blocks * spec.block_size, *shape[4:])
        # Copies and gathers go through same-width integer views: bit-exact for every dtype, and on CPU
        # fp8 has no index_copy_ while bf16 index_select of 64-token blocks ran ~50x slower than int16.
        self._bits = _INT_VIEW[self.kv_cache.element_size()]
        self._cache_bits = self.kv_cache.view(self._bits)
        self._flat_bits = self.kv_flat.view(self._bits)
        # 3-D views for indexed copies along dim 1 (see kernels' module docstring for why)
        self._slot_rows = self._flat_bits.view(2 * num_layers, -1, spec.num_kv_heads * spec.head_dim)  # [2L, S, H*D]
        # The pool as numpy token rows, for the CPU's write kernel (`kernels.scatter_rows`)
        self._token_rows = kernels.token_rows(self.kv_flat) if self.device.type == "cpu" else None

    @property
    def nbytes(self) -> int:
        """Bytes of the materialised pool (0 when accounting only); not the simulated budget."""
        s = self.spec
        return 2 * self.num_layers * self.num_blocks * s.block_size * s.num_kv_heads * s.head_dim * self.dtype.itemsize

    @property
    def enabled(self) -> bool:
        """False for an accounting-only cache (num_layers=0): every method is then a no-op."""
        return self.kv_cache is not None

    def _index(self, values) -> torch.Tensor:
        """An int64 index tensor on the device from any int sequence or array (same shape).

        On CUDA the indices are staged in pinned memory: a copy from pageable memory may make the driver wait
        for the stream's queued kernels (a host sync in the step loop); a pinned one is queued and returns, and
        the caching host allocator keeps the staging block until the copy has run.
        """
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if self.device.type == "cuda":
            return host.pin_memory().to(self.device, non_blocking=True)
        return host

    # --- integrity bookkeeping (IntegrityPatterns) ----------------------------------------------------
    def register(self, seq_id: int, token_ids: np.ndarray) -> None:
        """Tell integrity mode the token ids of `seq_id` (prompt + output), so values follow token content.

        A request never registered gets values derived from (seq_id, position): still token-unique, but
        then another request reading its blocks through the prefix cache would (rightly) fail `verify`.
        """
        if self.integrity:
            self.patterns.register(seq_id, token_ids)

    def forget(self, seq_id: int) -> None:
        """Drop a finished request's fingerprints (its blocks may stay cached for others)."""
        self.patterns.forget(seq_id)

    # --- writes -----------------------------------------------------------------------------------

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

    def write(self, slots: np.ndarray, seq_ids: np.ndarray, positions: np.ndarray, groups=None) -> None:
        """Store the K/V of N new tokens (all materialised layers) at `slots`: one scatter, timed as "write".

        slots, seq_ids, positions: (N,) int arrays (from the allocators' `slot_mapping`). Without integrity
        the data is random; with it, each token's bit patterns (see `IntegrityPatterns.expected`; `groups`, (N,)
        or None: the KV cache group of each slot's block, whose layers write their own K/V).
        """
        if not self.enabled or len(slots) == 0:
            return
        slots = np.asarray(slots, dtype=np.int64)
        assert slots.min() >= 0 and slots.max() < self.num_slots, "slot outside the pool"
        if self.integrity:
            vals = self.patterns.expected(np.asarray(seq_ids), np.asarray(positions), groups)
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

    # --- reads ------------------------------------------------------------------------------------

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

    def verify(self, seq_id: int, slots: np.ndarray, positions: np.ndarray, group: int = 0) -> None:
        """Integrity mode: assert the pool at `slots` holds what `seq_id`'s tokens at `positions` wrote (in blocks
        of KV cache group `group`).

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
        groups = np.full(len(slots), group, dtype=np.int64) if group else None
        where = (lambda n: f"slot {int(slots[n])}, group {group}") if group else (lambda n: f"slot {int(slots[n])}")
        self.patterns.check(got, ids, np.asarray(positions, dtype=np.int64), where, groups)

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

    # --- swaps ------------------------------------------------------------------------------------

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
