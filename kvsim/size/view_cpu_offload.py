"""`kvsim size --cpu-offload`'s lines: the CPU tier as vLLM 0.33.0 builds it (the math is `cpu_offload`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvsim.size.cpu_offload import CpuOffload
from kvsim.units import format_bytes

if TYPE_CHECKING:
    from kvsim.size.console import SizeConsole


def print_cpu_tier(console: SizeConsole, cpu: CpuOffload) -> None:
    """The tier's chunks, their size, and what requests of max_model_len tokens hold there."""
    lines = [
        f"CPU tier (vLLM OffloadingConnector): {format_bytes(cpu.cpu_bytes_to_use)} for the engine, "
        f"{cpu.world_size} rank{'s' if cpu.world_size > 1 else ''}"
        + (", one replicated copy (MLA)" if cpu.num_copies == 1 and cpu.world_size > 1 else ""),
        f"  CPU block: {cpu.cpu_block_size:,} tokens ({cpu.blocks_per_chunk} GPU block{'s' if cpu.blocks_per_chunk > 1 else ''}), "
        f"{cpu.chunk_bytes_aligned:,} B padded to 4 KiB ({cpu.chunk_bytes_per_rank:,} B a rank)",
        f"  num_cpu_blocks: {cpu.num_cpu_blocks:,} on every rank, {format_bytes(cpu.cpu_offload_bytes)} of host memory in all"
        + (" (one copy every rank reads)" if cpu.num_copies == 1 and cpu.world_size > 1 else
           f" ({format_bytes(cpu.num_cpu_blocks * cpu.chunk_bytes_per_rank)} is each rank's slice)" if cpu.world_size > 1 else ""),
        f"  a request of {cpu.max_model_len:,} tokens stores {cpu.chunks_per_request:,} CPU blocks ({_groups_text(cpu.groups)})",
        f"  CPU KV cache size: {cpu.kv_cache_size_tokens:,} tokens, {cpu.max_requests:.2f} such requests",
    ]
    for line in lines:
        console.print(line, highlight=False, soft_wrap=True)


def _groups_text(groups) -> str:
    """'6 sliding groups: at most 64 each, full: every block'."""
    counts: dict[tuple, int] = {}
    for g in groups:
        key = (g.kind, g.window_chunks)
        counts[key] = counts.get(key, 0) + 1
    parts = []
    for (kind, window), n in counts.items():
        name = f"{n} {kind} groups" if n > 1 else kind
        parts.append(f"{name}: " + ("every block" if window is None else f"at most {window}" + (" each" if n > 1 else "")))
    return ", ".join(parts)
