"""vLLM 0.33.0's CPU KV tier as `--kv-offloading-size` builds it: chunk (CPU block) size, chunks per rank, bytes.

Each step names the vLLM function it follows (docs/cpu-tier.md has the rules as read); pure integers, no torch.
`tests/size/test_cpu_offload.py` checks the figures against vLLM's own `CPUOffloadingSpec` and
`CPUOffloadingInfo` run from the wheel.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsim.errors import KvsimError
from kvsim.size.kv_cache_spec import VllmGroup
from kvsim.size.sizing import cdiv
from kvsim.size.vllm_capacity import VllmStartup
from kvsim.size.vllm_settings import VLLM_VERSION

# `SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT = mmap.PAGESIZE`: every chunk is padded to a host page (4 KiB on x86-64
# and on aarch64 with 4 KiB pages).
HOST_PAGE_BYTES = 4096
GIB = 1 << 30


@dataclass(frozen=True)
class CpuOffloadGroup:
    """One KV cache group as the offloading connector sees it (`OffloadingGroupConfig`)."""

    kind: str
    tokens_per_block: int  # the GPU block of this group
    tokens_per_chunk: int  # tokens_per_block x blocks_per_chunk: one offload key covers this many tokens
    window_chunks: int | None  # `sliding_window_size_in_chunks`: chunks a request keeps; None: every chunk


@dataclass(frozen=True)
class CpuOffload:
    """The CPU tier of one engine (all TP ranks): vLLM's `CPUOffloadingSpec` and `CPUOffloadingInfo` figures.

    One chunk holds `blocks_per_chunk` GPU blocks of every rank (each rank writes its own slice), padded to a host
    page; the chunk count is the same on every rank. A key of any group takes a whole chunk, so a model with G
    groups stores up to G chunks per `cpu_block_size` tokens of a prompt.
    """

    cpu_bytes_to_use: int  # the whole engine's budget, every rank's share included (`cpu_bytes_to_use`)
    blocks_per_chunk: int
    world_size: int
    num_copies: int  # world_size, or 1 for the replicated (MLA, tp > 1) layout
    worker_bytes_per_block: int  # `worker_kv_bytes_per_block`: one GPU block id on one rank
    groups: tuple[CpuOffloadGroup, ...]
    max_model_len: int

    @property
    def cpu_block_size(self) -> int:
        """Tokens one chunk (CPU block) covers, of the first group (all groups share it unless their GPU blocks differ)."""
        return self.groups[0].tokens_per_chunk

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one chunk before padding: every copy's blocks (`kv_bytes_per_chunk`)."""
        return self.worker_bytes_per_block * self.num_copies * self.blocks_per_chunk

    @property
    def chunk_bytes_aligned(self) -> int:
        """One chunk padded to a host page (`round_up(kv_bytes_per_chunk, BLOCK_SIZE_ALIGNMENT)`)."""
        return cdiv(self.chunk_bytes, HOST_PAGE_BYTES) * HOST_PAGE_BYTES

    @property
    def chunk_bytes_per_rank(self) -> int:
        """One rank's slice of a chunk (`cpu_page_size_per_worker`)."""
        return self.chunk_bytes // self.num_copies

    @property
    def num_cpu_blocks(self) -> int:
        """Chunks in the tier (`CPUOffloadingSpec.num_chunks`), the same number on every rank."""
        return self.cpu_bytes_to_use // self.chunk_bytes_aligned

    @property
    def cpu_offload_bytes(self) -> int:
        """Bytes the tier really holds: chunks x padded chunk (`cpu_kv_cache_size_bytes`)."""
        return self.num_cpu_blocks * self.chunk_bytes_aligned

    @property
    def chunks_per_request(self) -> int:
        """Chunks one request of max_model_len tokens stores: each group's chunks, a window's at most."""
        total = 0
        for g in self.groups:
            n = cdiv(self.max_model_len, g.tokens_per_chunk)
            total += n if g.window_chunks is None else min(n, g.window_chunks)
        return total

    @property
    def kv_cache_size_tokens(self) -> int:
        """`cpu_kv_cache_size_tokens`: tokens the tier holds for requests of max_model_len tokens."""
        return self.num_cpu_blocks * self.max_model_len // self.chunks_per_request

    @property
    def max_requests(self) -> float:
        """Requests of max_model_len tokens the tier holds at once."""
        return self.num_cpu_blocks / self.chunks_per_request

    def as_json(self) -> dict:
        return {
            "cpu_offload_bytes": self.cpu_offload_bytes,
            "cpu_bytes_to_use": self.cpu_bytes_to_use,
            "cpu_block_size": self.cpu_block_size,
            "cpu_blocks_per_chunk": self.blocks_per_chunk,
            "vllm_num_cpu_blocks": self.num_cpu_blocks,
            "cpu_chunk_bytes": self.chunk_bytes_aligned,
            "cpu_chunk_bytes_per_rank": self.chunk_bytes_per_rank,
            "cpu_bytes_per_rank": self.num_cpu_blocks * self.chunk_bytes_per_rank,
            "cpu_replicated_layout": self.num_copies == 1 and self.world_size > 1,
            "cpu_chunks_per_request": self.chunks_per_request,
            "cpu_kv_cache_size_tokens": self.kv_cache_size_tokens,
            "cpu_max_requests": round(self.max_requests, 4),
            "cpu_groups": [
                {"kind": g.kind, "tokens_per_chunk": g.tokens_per_chunk, "window_chunks": g.window_chunks} for g in self.groups
            ],
        }


def window_chunks(group: VllmGroup, tokens_per_chunk: int) -> int | None:
    """`get_sliding_window_size_in_chunks`: chunks a request of this group can ever load back; None for full attention.

    A sliding window: cdiv(window, chunk) (no extra retained tokens without multi-module speculative decoding);
    a chunked-local layer: cdiv(chunk, tokens_per_chunk); a state (Mamba) group: its one state, 1.
    """
    if group.kind == "sliding":
        return max(cdiv(group.window, tokens_per_chunk), cdiv(group.window - 1, tokens_per_chunk))
    if group.kind == "chunked":
        return cdiv(group.window, tokens_per_chunk)
    if group.kind == "state":
        return 1
    return None


def cpu_offload(
    startup: VllmStartup,
    cpu_bytes: int,
    *,
    tp: int = 1,
    cpu_block_size: int | None = None,
    replicated: bool = False,
    field: str = "--cpu-offload",
    block_size_field: str = "--cpu-block-size",
) -> CpuOffload:
    """The CPU tier `cpu_bytes` (the whole engine's, as `--kv-offloading-size` gives it) buys for this pool.
    Errors name `field` (the bytes) and `block_size_field` (the chunk size) as the caller's input calls them.

    `cpu_block_size` is the connector's `block_size` (tokens per chunk; a multiple of the GPU block, all groups
    of one block size), None for vLLM's default of one GPU block per chunk (`build_offloading_config`).
    `replicated`: every rank holds the same KV (pure MLA at tp > 1), so a chunk stores one copy.
    """
    if cpu_bytes <= 0:
        raise KvsimError(f"must be positive, got {cpu_bytes}", field=field)
    kinds = {g.kind == "state" for g in startup.groups}
    if startup.settings.mamba_cache_mode != "align" and kinds == {True, False}:
        # `build_offloading_config` asserts tokens_per_block % tokens_per_hash == 0: beside attention groups, a
        # state group's block is max_model_len unless prefix caching aligns it (an attention-free model's one
        # group hashes at its own block)
        raise KvsimError(
            f"vLLM {VLLM_VERSION} offloads a hybrid (state) model only with prefix caching on: give --mamba-cache-mode align",
            field="--mamba-cache-mode",
        )
    blocks_per_chunk = 1
    if cpu_block_size is not None:
        sizes = {g.block_size for g in startup.groups}
        if len(sizes) != 1:
            raise KvsimError(f"the groups' GPU blocks differ ({sorted(sizes)} tokens): vLLM takes no chunk size in "
                             "tokens then", field=block_size_field)
        gpu_block = sizes.pop()
        if cpu_block_size <= 0 or cpu_block_size % gpu_block:
            raise KvsimError(f"must be a positive multiple of the GPU block ({gpu_block} tokens), got {cpu_block_size}",
                             field=block_size_field)
        blocks_per_chunk = cpu_block_size // gpu_block
    groups = tuple(
        CpuOffloadGroup(g.kind, g.block_size, g.block_size * blocks_per_chunk, window_chunks(g, g.block_size * blocks_per_chunk))
        for g in startup.groups
    )
    return CpuOffload(
        cpu_bytes_to_use=cpu_bytes,
        blocks_per_chunk=blocks_per_chunk,
        world_size=tp,
        num_copies=1 if replicated and tp > 1 else tp,
        worker_bytes_per_block=startup.bytes_per_block,
        groups=groups,
        max_model_len=startup.max_model_len,
    )


def model_cpu_offload(report, cpu_bytes: int, *, cpu_block_size: int | None = None, field: str = "--cpu-offload") -> CpuOffload:
    """The CPU tier for a `kvsim size` report's model, TP and settings (the GPU budget does not enter it)."""
    from kvsim.size.vllm import vllm_layers, vllm_startup

    if report.model.vllm_unserved:
        raise KvsimError(f"vLLM {VLLM_VERSION} does not serve this model, so it builds no CPU tier for it", field=field)
    layers = vllm_layers(report.model, report.spec, report.tp)
    startup = vllm_startup(layers, 1, report.context_tokens, report.spec.block_size, report.settings) if layers else None
    if startup is None:
        raise KvsimError(f"vLLM {VLLM_VERSION}'s KV cache groups for this model are not modelled, so neither is its CPU tier",
                         field=field)
    replicated = all(layer.kind == "mla" for layer in layers)  # `replicated_layout`: MLA's latent is on every rank
    return cpu_offload(startup, cpu_bytes, tp=report.tp, cpu_block_size=cpu_block_size, replicated=replicated, field=field)


def parse_offloading_size(text: str, *, field: str) -> int:
    """`--kv-offloading-size` as `vllm serve` takes it: GiB for the whole engine, summed over TP ranks
    (`CacheConfig.kv_offloading_size`; `VllmConfig._post_init_kv_transfer_config`: `cpu_bytes_to_use = size * (1 << 30)`)."""
    try:
        gib = float(text)
    except ValueError:
        gib = float("nan")
    if not 0 < gib < float("inf"):
        raise KvsimError(f"expected GiB as vllm serve takes them, like 64 or 0.5, got {text!r}", field=field)
    return int(gib * GIB)
