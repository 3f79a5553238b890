"""The model runner: moves each scheduled row's real K/V through the cache tensors (writes every step,
sampled reads + decode attention), and checks integrity when it is on."""

from __future__ import annotations

import numpy as np

from kvsim.replay.sched.output import SchedSeq, SchedulerOutput


def read_groups(lens: np.ndarray, *, one: bool = False) -> list[np.ndarray]:
    """Indices of a decode batch split for its reads: by length, longest first, a new group wherever a length
    falls under half its group's longest, so no group pads a sequence to more than twice its tokens.

    A read pads every sequence to its batch's longest; on the main job's paged batches one padded read moved
    about 4x the bytes the sequences hold (~1 GiB for ~250 MiB), and on a CPU bytes are the read's cost, in
    time and in resident memory. `one=True` (CUDA, where a kernel launch costs more than padding) keeps the
    whole batch in one group.
    """
    if one or len(lens) <= 1:
        return [np.arange(len(lens))]
    order = np.argsort(-lens, kind="stable")  # longest first
    ordered = lens[order]
    groups, start = [], 0
    for i in range(1, len(order)):
        if 2 * ordered[i] < ordered[start]:
            groups.append(order[start:i])
            start = i
    groups.append(order[start:])
    return groups


class ModelRunner:
    """Moves the real K/V of each scheduled row through the cache tensors (nano-vllm's model runner, minus
    the model): every step one scatter of its new tokens; every `read_every`-th decode step a batched read of
    every decoding request's whole context and decode attention over it (the sampled measurement).

    A row that covers a run of k decode steps is executed as its k steps (one timer step each), so kernel
    times are always per step, whatever the bookkeeping did in one go. With integrity on, each request's
    whole KV is also checked in the pool when it finishes, right after a swap-in, and after an admission that
    reuses blocks others wrote (prefix hit, copy on write): a token's KV is written once and must survive
    until its request finishes, so a block owned twice or overwritten cannot go unseen.
    """

    def __init__(self, cache, allocator, *, read_every: int = 1, estimate_reads: bool = False,
                 all_groups: bool = False):
        assert read_every >= 1
        self.cache = cache
        self.allocator = allocator
        # A mixed model's other token groups (`all_groups`, for a CPU tier that moves every group's blocks): each
        # new token's K/V goes to its block in every group's table too (vLLM: each group's layers write their own
        # blocks of the layer tensors the groups share), and integrity checks every group's blocks. Without it,
        # the slot group's blocks alone hold K/V.
        self.other_groups = allocator.token_groups[1:] if all_groups else []
        assert not self.other_groups or allocator.token_groups[0] == 0  # the slot group's patterns are group 0's
        self.read_every = read_every
        # Measured timing with sampled reads: a step that does not read gets the last sample's read and
        # attention µs per context token times its own context tokens (`estimate`, reset every row).
        self.estimate_reads = estimate_reads
        self.estimate: dict[str, float] = {}
        self._us_per_token: dict[str, float] = {}
        self.paged = allocator.paged
        self.num_decode_steps = 0  # decode steps executed so far: the read sampling counter
        self.num_read_samples = 0  # steps that read and attended

    def execute(self, out: SchedulerOutput) -> None:
        cache, alloc = self.cache, self.allocator
        decodes, k = out.decodes, out.num_steps
        self.estimate = {}
        starts = np.array([seq.num_computed_tokens for seq in decodes], dtype=np.int64)  # (num_decodes,)
        decode_ids = np.array([seq.seq_id for seq in decodes], dtype=np.int64)  # (num_decodes,)
        run_slots = None  # (k, num_decodes): slot of each decoding request's token in each step of the row
        if decodes:
            run_slots = alloc.decode_slot_mapping(decodes, starts, k)
        # Step 0: the prefill chunks and the first decode token of each request, one scatter.
        slots = [alloc.slot_mapping(seq, s, s + m) for seq, s, m in out.prefills]
        ids = [np.full(m, seq.seq_id, dtype=np.int64) for seq, _, m in out.prefills]
        positions = [np.arange(s, s + m, dtype=np.int64) for _, s, m in out.prefills]
        if decodes:
            slots.append(run_slots[0])
            ids.append(decode_ids)
            positions.append(starts)
        groups = None  # the KV cache group of each slot's block (None: the slot group's alone)
        if self.other_groups:  # the same tokens into the other groups' blocks, in the same scatter
            assert k == 1, "the other groups' writes go step by step (no decode runs)"
            rows = [(seq, s, s + m) for seq, s, m in out.prefills] + [(seq, int(s), int(s) + 1) for seq, s in zip(decodes, starts)]
            n = sum(e - s for _, s, e in rows)
            for g in self.other_groups:
                slots += [alloc.group_slot_mapping(seq, g, s, e) for seq, s, e in rows]
            ids *= 1 + len(self.other_groups)
            positions *= 1 + len(self.other_groups)
            groups = np.repeat(np.array(alloc.token_groups, dtype=np.int64), n)  # (N,), the slot group (0) first
        if slots:
            cache.write(np.concatenate(slots), np.concatenate(ids), np.concatenate(positions), groups)  # (N,) each
        if decodes:
            self._decode_steps(decodes, run_slots, starts, decode_ids)
        if cache.integrity:
            self._verify_row(out)

    def _decode_steps(self, decodes, run_slots: np.ndarray, starts: np.ndarray, decode_ids: np.ndarray) -> None:
        """Steps 1..k-1 of a decode run (one scatter each), with a read + attention at the sampled steps."""
        cache, k, every = self.cache, len(run_slots), self.read_every
        first = (-self.num_decode_steps) % every  # the row's first step whose global decode index is sampled
        self.num_decode_steps += k
        tables, complete = None, True
        if self.estimate_reads and first >= k and self._us_per_token:  # no read in this row: scale the last one
            tokens = int(starts.sum()) + k * len(starts)
            self.estimate = {kind: us * tokens for kind, us in self._us_per_token.items()}
        if self.paged and first < k:
            raw = [self.allocator.block_table(seq) for seq in decodes]
            complete = all(b is not None for table in raw for b in table)  # a sliding window frees old blocks
            tables = [np.array([0 if b is None else b for b in table], dtype=np.int64) for table in raw]
        done = 1  # steps written so far (step 0 by `execute`)
        for j in [*range(first, k, every), None]:  # the sampled steps, then the row's end
            last = k - 1 if j is None else j
            if done <= last:  # write steps done..last, each in its own timer step
                cache.timer.new_step()
                positions = starts[None, :] + np.arange(done, last + 1)[:, None]  # (steps, num_decodes)
                cache.write_steps(run_slots[done : last + 1], decode_ids, positions)
                done = last + 1
            if j is None:
                break
            lens = starts + j + 1  # (num_decodes,)
            slabs = None if self.paged else [self.allocator.slab(seq)[0] for seq in decodes]
            for group in read_groups(lens, one=cache.device.type != "cpu"):
                glens, gids = lens[group].tolist(), decode_ids[group].tolist()
                if self.paged:
                    read = cache.read_paged([tables[i] for i in group], glens, gids if complete else None)
                else:
                    read = cache.read_flat([slabs[i] for i in group], glens, gids)
                cache.decode_attention(read)  # the step's read and attention times add up over the groups
            self.num_read_samples += 1
            if self.estimate_reads:
                times, tokens = cache.timer.step_times(), int(lens.sum())
                self._us_per_token = {kind: times[kind] / tokens for kind in ("read", "attention") if kind in times}

    def _verify_row(self, out: SchedulerOutput) -> None:
        """Integrity: the whole KV of requests that finish in this row, were swapped in, or were admitted onto
        blocks they did not write (prefix hits, copy on write), checked in the pool after the row's writes."""
        admitted = {seq.seq_id for seq in out.admitted}
        for seq, start, num in out.prefills:
            if start + num >= seq.num_final_tokens:
                self._verify(seq, seq.num_final_tokens)
            elif start and seq.seq_id in admitted:
                self._verify(seq, start)
        for seq in out.swapped_in:
            self._verify(seq, seq.num_computed_tokens)
        k = out.num_steps
        for seq in out.decodes:
            if seq.num_computed_tokens + k >= seq.num_final_tokens:
                self._verify(seq, seq.num_final_tokens)

    def _verify(self, seq: SchedSeq, end: int) -> None:
        """Check positions [0, end) of `seq` in the pool (from its first held block: a sliding window frees old ones)."""
        begin = 0
        if self.paged:
            table = self.allocator.block_table(seq)
            bs = self.allocator.block_size
            held = next((j for j, b in enumerate(table) if b is not None), len(table))
            begin = min(held * bs, end)
            window = self.allocator.slot_window
            if window is not None:
                # Positions before the window's first block are never read again; a swap-out dropped them, and
                # the swap-in gives them fresh (unwritten) blocks, so only the window is checked.
                begin = max(begin, min(end, max(0, end - window) // bs * bs))
        slots = self.allocator.slot_mapping(seq, begin, end)  # (end - begin,)
        self.cache.verify(seq.seq_id, slots, np.arange(begin, end, dtype=np.int64))
        for g in self.other_groups:  # from each group's first held block (a window nulls those it left)
            table, bs = self.allocator.block_tables(seq)[g], self.allocator.block_size
            held = next((j for j, b in enumerate(table) if b), len(table))
            begin = min(held * bs, end)
            slots = self.allocator.group_slot_mapping(seq, g, begin, end)  # (end - begin,)
            self.cache.verify(seq.seq_id, slots, np.arange(begin, end, dtype=np.int64), group=g)
