"""The command line: declares commands and options, forwards to plain functions, nothing else.

Heavy modules (torch, pandas, matplotlib) are imported inside the commands that need them, so
`kvsim --help` and `kvsim size` start fast.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
from typing import Callable, TypeVar

import typer
import typer.core

from kvsim.errors import KvsimError
from kvsim.out_paths import out_option

app = typer.Typer(
    name="kvsim",
    help="KV-cache sizing, paged-allocator simulation and real GPU measurements.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

F = TypeVar("F", bound=Callable)

# typer's --help labels a flag `<bool>`, as if it took a value; a flag (--json, --no-tensors) shows no type.
# Older typer (before display_type_rich) has no such label to take off.
_option_type = getattr(typer.core.TyperOption, "display_type_rich", None)
if _option_type is not None:
    typer.core.TyperOption.display_type_rich = lambda self, ctx: None if self.is_flag else _option_type(self, ctx)


def _help_table():
    """typer's --help option tables, never cutting an option's name at any terminal width.

    typer lays an option out as cells (required mark, long names, short names, negative long, negative short,
    type, help) that rich shrinks with an ellipsis when the terminal is narrow ("--max-num-batched-…"). Here an
    option's names (aliases, the negative flag) go one a line in one cell, and every cell but the help text
    keeps its width: only the help column wraps. Built lazily: rich's table module loads with the help screen only.
    """
    from rich.columns import Columns
    from rich.table import Table
    from rich.text import Text

    class HelpTable(Table):
        def add_row(self, *cells, **kwargs):
            if len(cells) >= 6:  # an options panel's row: [required,] long, short, -no long, -no short, type, help
                *head, long, short, neg_long, neg_short, types, help_ = cells
                names = [n for cell in (long, neg_long) for n in cell.split(",") if n.plain]  # one name a line
                if isinstance(help_, Columns) and all(isinstance(r, Text) for r in help_.renderables):
                    help_ = Text(" ").join(help_.renderables)  # typer's help as one text, which folds, not cut
                cells = (*head, Text("\n").join(names), Text("\n").join(s for s in (short, neg_short) if s.plain), types, help_)
            super().add_row(*cells, **kwargs)

        def __rich_console__(self, console, options):
            for column in self.columns[:-1]:
                column.no_wrap = True
            if self.columns:
                self.columns[-1].overflow = "fold"  # a word longer than the help column breaks, never cut
            yield from super().__rich_console__(console, options)

    return HelpTable


def _uncut_help(format_help):
    @functools.wraps(format_help)
    def wrapper(self, ctx, formatter):
        import typer.rich_utils

        if not getattr(typer.rich_utils.Table, "kvsim_help", False):
            typer.rich_utils.Table = _help_table()
            typer.rich_utils.Table.kvsim_help = True
        return format_help(self, ctx, formatter)

    return wrapper


typer.core.TyperCommand.format_help = _uncut_help(typer.core.TyperCommand.format_help)
typer.core.TyperGroup.format_help = _uncut_help(typer.core.TyperGroup.format_help)


def _show_version(value: bool) -> None:
    if value:
        from kvsim import __version__

        typer.echo(f"kvsim {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(False, "--version", help="Print kvsim's version and exit.", callback=_show_version, is_eager=True),
) -> None:
    """KV-cache sizing, paged-allocator simulation and real GPU measurements."""


def user_errors(fn: F) -> F:
    """The one place a KvsimError becomes one line on stderr and exit code 2; an empty value of any option or
    argument is one too (`_refuse_empty`), before the command does anything."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            _refuse_empty(fn, kwargs)
            return fn(*args, **kwargs)
        except KvsimError as exc:
            typer.echo(f"kvsim: error: {exc}", err=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def _refuse_empty(fn: Callable, kwargs: dict) -> None:
    """A KvsimError naming the first option (or argument) of command `fn` given as '' (or blanks).

    An empty value otherwise passed for "not given": `--trace ''` replayed the workload's own requests, `--gpu ''`
    dropped the start-up section, `--model ''` of `cache-curve` read the current directory as the model's folder.
    `--out` has its own check (`kvsim.out_paths.out_option`), which also names what to give.
    """
    for name, value in kwargs.items():
        values = value if isinstance(value, (list, tuple)) else (value,)
        if name != "out" and any(isinstance(v, str) and not v.strip() for v in values):
            option, label = _parameter_label(fn, name)
            raise KvsimError("an empty value; give one, or leave the option out" if option else "an empty value", field=label)


def _parameter_label(fn: Callable, name: str) -> tuple[bool, str]:
    """(is an option, its first long flag or an argument's metavar) for parameter `name` of command `fn`, read
    from its `Annotated[..., typer.Option(...)]` (typer takes an Annotated Option's first positional as a flag)."""
    import typing

    from typer.models import OptionInfo, ParameterInfo

    hint = typing.get_type_hints(fn, include_extras=True).get(name)
    info = next((m for m in getattr(hint, "__metadata__", ()) if isinstance(m, ParameterInfo)), None)
    if isinstance(info, OptionInfo):
        decls = (info.default, *info.param_decls) if isinstance(info.default, str) else tuple(info.param_decls or ())
        return True, next((d for d in decls if d.startswith("--")), "--" + name.replace("_", "-"))
    return False, (getattr(info, "metavar", None) or name.upper())


# --- commands -----------------------------------------------------------------------------------------
# Each command below only parses options and calls one function of a logic module.


from typing import Annotated, Optional  # noqa: E402  (kept next to the commands that use them)


@app.command()
@user_errors
def size(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Catalogue name (qwen3-0.6b) or HF id (Qwen/Qwen3-0.6B).")] = None,
    config: Annotated[Optional[str], typer.Option("--config", help="Path to a Hugging Face config.json (read offline).")] = None,
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", "--kv-cache-dtype", help="KV cache dtype: auto (what the checkpoint's quantization_config asks for, else the model's), bf16, fp16, fp32, fp8 (fp8_e4m3, fp8_e5m2), int8.")] = "auto",
    block_size: Annotated[int, typer.Option("--block-size", help="Tokens per KV block.")] = 16,
    context: Annotated[Optional[int], typer.Option("--context", "--max-model-len", help="Tokens per sequence (default: the model's max length).")] = None,
    tp: Annotated[int, typer.Option("--tp", "--tensor-parallel-size", "-tp", help="Tensor-parallel ranks; figures are per rank.")] = 1,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help="GPU from the catalogue (h100-80gb, h200, a100-80gb, l40s, rtx-4090, b200, mi300x, ...; 26 cards: docs/size.md).")] = None,
    memory: Annotated[Optional[str], typer.Option("--memory", help="Device memory instead of --gpu, as CUDA reports it, e.g. 79.19GiB.")] = None,
    utilization: Annotated[float, typer.Option("--utilization", "--gpu-memory-utilization", help="vLLM's gpu_memory_utilization (0.33's default 0.92).")] = 0.92,
    weight_dtype: Annotated[Optional[str], typer.Option("--weight-dtype", help="Weight dtype: bf16/fp16/fp32 (vLLM's --dtype) or fp8/int8 (runtime --quantization); default: the checkpoint's.")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option("--max-num-batched-tokens", help="vLLM's chunked-prefill budget (default: vllm serve's for the GPU: 8192 on 70+ GiB, 16384 on 160+ GiB, 2048 on A100 and smaller).")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option("--max-num-seqs", help="vLLM's max_num_seqs: the sampler rows of the profile run (default: vllm serve's, 1024 or 256).")] = None,
    enforce_eager: Annotated[bool, typer.Option("--enforce-eager", help="No CUDA graphs: no graph memory estimate.")] = False,
    kv_cache_memory: Annotated[Optional[str], typer.Option("--kv-cache-memory", help="vLLM's kv_cache_memory_bytes, e.g. 20GiB: the KV budget itself, utilization ignored.")] = None,
    prefix_caching: Annotated[Optional[bool], typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="Hybrid models: vllm serve's prefix caching, as --mamba-cache-mode align (on) or none (off).", show_default=False)] = None,
    kernel_block_size: Annotated[int, typer.Option("--kernel-block-size", help="Hybrid (mamba) models: the attention backend's kernel block that vLLM's raised block_size is a multiple of.")] = 16,
    mamba_cache_mode: Annotated[Optional[str], typer.Option("--mamba-cache-mode", help="Hybrid models: vLLM's mamba_cache_mode, none (prefix caching off) or align (prefix caching on). Default: vllm serve's, align for a hybrid model, none for an attention-free one.", show_default=False)] = None,
    mamba_checkpoint_alignment: Annotated[Optional[int], typer.Option("--mamba-checkpoint-alignment", help="Hybrid models in align mode: the state layers' prefill checkpoint alignment; 0: none. Default: vllm serve's for the GPU, 64 for gated delta nets (Qwen3-Next, Qwen3.5) on Hopper (FlashInfer's prefill), else 0.", show_default=False)] = None,
    async_scheduling: Annotated[bool, typer.Option("--async-scheduling/--no-async-scheduling", help="vLLM's async scheduling (on in vllm serve): two batches in flight enter the sliding-window bound.")] = True,
    params: Annotated[Optional[float], typer.Option("--params", help="Total parameter count, e.g. 8.03e9 (needed with --config for weights).")] = None,
    layout: Annotated[bool, typer.Option("--layout", help="Print the KV pool tensor's shape, strides and bytes.")] = False,
    num_blocks: Annotated[Optional[int], typer.Option("--num-blocks", help="Blocks in the pool for --layout / --address.")] = None,
    address: Annotated[Optional[str], typer.Option("--address", help="Print the byte offset of the element at kv, layer, block, token, head, dim (comma-separated).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of tables.")] = False,
    step_time: Annotated[bool, typer.Option("--step-time", help="With --gpu: a decode step's time at the maximum concurrency on the kernels-db clock (needs kvsim\\[perfdb]).")] = False,
    cpu_offload: Annotated[Optional[str], typer.Option("--cpu-offload", help="A CPU KV tier for the whole engine, e.g. 100GiB: vLLM's CPU blocks (chunks), their size and what a request holds there.", show_default=False)] = None,
    kv_offloading_size: Annotated[Optional[str], typer.Option("--kv-offloading-size", help="The same in GiB, as vllm serve takes it (summed over TP ranks).", show_default=False)] = None,
    cpu_block_size: Annotated[Optional[int], typer.Option("--cpu-block-size", help="With a CPU tier: tokens per CPU block, a multiple of the GPU block (the connector's block_size; default one GPU block).", show_default=False)] = None,
) -> None:
    """KV bytes per token, block and sequence for a model; with --gpu/--memory, vLLM 0.33's start-up memory
    accounting and how many tokens and requests fit (exit 2 where vLLM would not start)."""
    from kvsim.size.view import show_size

    if prefix_caching is not None:
        mamba_cache_mode = "align" if prefix_caching else "none"  # None: vllm serve's default for the model
    show_size(
        model, config, kv_dtype=kv_dtype, block_size=block_size, context=context, tp=tp, gpu=gpu, memory=memory,
        utilization=utilization, weight_dtype=weight_dtype, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, enforce_eager=enforce_eager, kv_cache_memory=kv_cache_memory,
        kernel_block_size=kernel_block_size, mamba_cache_mode=mamba_cache_mode,
        mamba_checkpoint_alignment=mamba_checkpoint_alignment, async_scheduling=async_scheduling, params=params, layout=layout, num_blocks=num_blocks,
        address=address, as_json=json_out, step_time=step_time,
        cpu_offload=cpu_offload, kv_offloading_size=kv_offloading_size, cpu_block_size=cpu_block_size,
    )


@app.command()
@user_errors
def models(
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON list instead of a table.")] = False,
) -> None:
    """List the model catalogue: layers by kind, KV heads, head_dim, KV bytes per token in bf16."""
    from kvsim.size.view_models import show_models

    show_models(as_json=json_out)


bench_app = typer.Typer(help="Benchmarks of kvsim's own machinery (allocator CPU cost, kernels).", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@bench_app.command("allocator")
@user_errors
def bench_allocator(
    num_requests: Annotated[int, typer.Option("--num-requests", help="Requests in the trace (prompts U[64,2048], outputs U[16,1024]).")] = 2000,
    max_running: Annotated[int, typer.Option("--max-running", help="Requests decoding at once.")] = 256,
    block_size: Annotated[int, typer.Option("--block-size", help="Tokens per KV block.")] = 16,
    prefix_caching: Annotated[bool, typer.Option("--prefix-caching/--no-prefix-caching", help="Key and cache full blocks.")] = True,
    hash_token_ids: Annotated[bool, typer.Option("--hash-token-ids", help="Requests carry token ids only, hashed block by block, instead of a replay's exact block keys.")] = False,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the synthetic trace.")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    out: Annotated[Optional[str], typer.Option("--out", help="Also write the result as a one-row CSV here.")] = None,
) -> None:
    """The paged allocator's CPU cost per decode and prefill token, timed around its calls only."""
    from pathlib import Path

    from kvsim.bench.allocator import show_allocator_bench

    show_allocator_bench(
        num_requests=num_requests, max_running=max_running, block_size=block_size, prefix_caching=prefix_caching,
        seed=seed, as_json=json_out, out=out_option(out), hash_token_ids=hash_token_ids,
    )


@app.command()
@user_errors
def plot(
    targets: Annotated[Optional[list[str]], typer.Argument(help="Report directories (default: every report under reports/), or `size` to draw --model sizes.", show_default=False)] = None,
    fmt: Annotated[str, typer.Option("--format", "-f", help="Image format: png, svg or pdf.")] = "png",
    model: Annotated[Optional[list[str]], typer.Option("--model", "-m", help="With `size`: a model to draw (repeat for several).")] = None,
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="With `size`: KV cache dtype (auto: what the checkpoint asks for, else the model's, as `kvsim size`).")] = "auto",
    tp: Annotated[int, typer.Option("--tp", help="With `size`: tensor-parallel ranks; figures are per rank.")] = 1,
    max_context: Annotated[Optional[int], typer.Option("--max-context", help="With `size`: right edge in tokens (default: each model's max length).")] = None,
    out: Annotated[str, typer.Option("--out", help="With `size`: directory for the chart.")] = "reports/size",
) -> None:
    """Charts of replay and bench reports, written next to them; `kvsim plot size -m A -m B` for bytes per sequence."""
    from kvsim.plots import plot as draw

    for path in draw(targets, fmt, models=model, kv_dtype=kv_dtype, tp=tp, max_context=max_context, out_dir=out_option(out)):
        typer.echo(str(path))


@app.command()
@user_errors
def replay(
    workload: Annotated[str, typer.Argument(help="Workload YAML, e.g. workloads/poisson.yaml.")],
    out: Annotated[Optional[str], typer.Option("--out", help="Report directory (default: reports/<workload name>/).")] = None,
    device: Annotated[str, typer.Option("--device", help="Cache tensors on cuda or cpu; auto: cuda if present, else cpu (1 layer, sampled reads).")] = "auto",
    no_tensors: Annotated[bool, typer.Option("--no-tensors", help="Accounting only: no cache tensors, no kernels.")] = False,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Override the workload's seed.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Replay only the first N requests.")] = None,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar and no table.")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print the summary as JSON on stdout.")] = False,
    timing: Annotated[str, typer.Option("--timing", help="Step clock: roofline (deterministic), measured (this run's kernel times), kernels-db (vLLM kernels measured on real GPUs: pip install kvsim\\[perfdb]) or auto (kernels-db where it applies, else roofline).")] = "roofline",
    trace: Annotated[Optional[str], typer.Option("--trace", help="Replay this trace file (Vidur/Azure/BurstGPT CSV, JSONL or Mooncake JSONL) instead of the workload's requests.")] = None,
    csv: Annotated[bool, typer.Option("--csv", help="Also write steps.csv next to steps.parquet.")] = False,
    layers: Annotated[int, typer.Option("--layers", help="Layers materialised in the cache tensors (byte figures always count all).")] = 1,
    integrity: Annotated[bool, typer.Option("--integrity", help="Write token-unique values and check every read (slow; for testing).")] = False,
    read_every: Annotated[Optional[int], typer.Option("--read-every", help="Read + attend on every N-th decode step; every step writes. Default: 100 on CUDA; on CPU 20000, or 100 with --timing measured (the steps between timed from the last read's µs per token).", show_default=False)] = None,
    max_host_memory: Annotated[str, typer.Option("--max-host-memory", help="Largest CPU cache pool to allocate (per allocator); a bigger one is refused before the replay runs.")] = "1GiB",
    tp: Annotated[Optional[int], typer.Option("--tp", "--tensor-parallel-size", "-tp", help="Tensor-parallel ranks (overrides the workload's deployment.tp): the KV pool and budget are one rank's, the clock prices the step with its all-reduces.", show_default=False)] = None,
    ep: Annotated[Optional[int], typer.Option("--ep", help="MoE experts over this many ranks: 1 or tp (vLLM's --enable-expert-parallel; overrides deployment.ep; kernels-db clock only).", show_default=False)] = None,
    # The workload's settings, under kvsim's names and vllm serve's (paste a `vllm serve` line's flags)
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Override the workload's model: catalogue name, HF id or config.json path.", show_default=False)] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", "--hardware", help="Override the workload's hardware (GPU from the catalogue).", show_default=False)] = None,
    utilization: Annotated[Optional[float], typer.Option("--utilization", "--gpu-memory-utilization", help="KV budget from this fraction of GPU memory, weights subtracted, instead of the workload's kv_budget.", show_default=False)] = None,
    max_model_len: Annotated[Optional[int], typer.Option("--max-model-len", help="Override the workload's max_model_len.", show_default=False)] = None,
    kv_dtype: Annotated[Optional[str], typer.Option("--kv-dtype", "--kv-cache-dtype", help="Override the workload's kv_dtype: auto, bf16, fp16, fp32, fp8, int8.", show_default=False)] = None,
    block_size: Annotated[Optional[int], typer.Option("--block-size", help="Tokens per block of every paged allocator.", show_default=False)] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option("--max-num-seqs", help="Override the scheduler's max_num_seqs.", show_default=False)] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option("--max-num-batched-tokens", help="Override the scheduler's max_num_batched_tokens.", show_default=False)] = None,
    prefix_caching: Annotated[Optional[bool], typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", "--prefix-caching/--no-prefix-caching", help="Prefix caching on (or off) for every paged allocator.", show_default=False)] = None,
    async_scheduling: Annotated[Optional[bool], typer.Option("--async-scheduling/--no-async-scheduling", help="vLLM's async scheduling (on in vllm serve, and the workload's default) or the synchronous loop (overrides scheduler.async_scheduling).", show_default=False)] = None,
    replicas: Annotated[Optional[int], typer.Option("--replicas", help="Engines of tp GPUs each behind a router, on one clock (overrides deployment.replicas; accounting only).", show_default=False)] = None,
    router: Annotated[Optional[str], typer.Option("--router", help="Router policy: random, round-robin, least-loaded, prefix-approx or prefix-precise (overrides router.policy).", show_default=False)] = None,
    cpu_offload: Annotated[Optional[str], typer.Option("--cpu-offload", help="CPU KV tier of this size under every allocator (e.g. 64GiB; 0: none), overriding the workload's offload.cpu_bytes (its policy kept, else lru).", show_default=False)] = None,
) -> None:
    """Replay a workload through every allocator it names, on a simulated clock; write reports/<name>/."""
    from pathlib import Path

    from kvsim.replay.view import run_replay_cli
    from kvsim.workload.overrides import WorkloadOverrides

    overrides = WorkloadOverrides(
        model=model, hardware=gpu, gpu_memory_utilization=utilization, max_model_len=max_model_len, kv_dtype=kv_dtype,
        block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
        prefix_caching=prefix_caching, async_scheduling=async_scheduling,
    )
    if replicas is not None and replicas < 1:
        raise KvsimError(f"must be >= 1, got {replicas}", field="--replicas")
    if replicas is not None or router is not None or _workload_replicas(workload) > 1:
        from kvsim.workload.overrides import load_workload_with

        loaded = load_workload_with(Path(workload), overrides, trace=trace, seed=seed, limit=limit)
        if (replicas or loaded.deployment.replicas) > 1 or router is not None:
            from kvsim.deployment.view import run_fleet_cli

            run_fleet_cli(loaded, replicas=replicas, router=router, out=out_option(out), timing=timing, tp=tp,
                          quiet=quiet, json_out=json_out, command=" ".join(["kvsim", *sys.argv[1:]]))
            return

    run_replay_cli(
        Path(workload), out=out_option(out), device=device, tensors=not no_tensors, seed=seed, limit=limit,
        quiet=quiet, json_out=json_out, timing=timing, trace=Path(trace) if trace else None, csv=csv, layers=layers,
        integrity=integrity, read_every=read_every, command=" ".join(["kvsim", *sys.argv[1:]]), max_host_memory=max_host_memory,
        tp=tp, ep=ep, cpu_offload=cpu_offload,
        overrides=overrides,
    )


@app.command()
@user_errors
def plan(
    target: Annotated[str, typer.Argument(metavar="WORKLOAD_OR_TRACE", help="A workload YAML, or a trace file (Mooncake JSONL, Vidur/Azure/BurstGPT CSV).")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model (a trace needs it; overrides a workload's).", show_default=False)] = None,
    gpu: Annotated[str, typer.Option("--gpu", help="GPU kinds to search, comma-separated, e.g. h100,h200.")] = "h100",
    tp: Annotated[str, typer.Option("--tp", help="Tensor-parallel sizes to search, comma-separated.")] = "1,2,4,8",
    replicas: Annotated[str, typer.Option("--replicas", help="Replica counts to search, comma-separated.")] = "1,2,3,4,6,8",
    slo: Annotated[str, typer.Option("--slo", help="Targets: ttft_p50, ttft_p99, tpot_p50, tpot_p99, e.g. ttft_p99=2s,tpot_p99=50ms.")] = "ttft_p99=2s,tpot_p99=50ms",
    router: Annotated[Optional[str], typer.Option("--router", help="Router policy (default: the workload's, else round-robin).", show_default=False)] = None,
    timing: Annotated[str, typer.Option("--timing", help="Step clock: kernels-db (required to cover every model/GPU/tp searched) or roofline (a bound, not a latency: only if you mean it).")] = "kernels-db",
    workers: Annotated[Optional[int], typer.Option("--workers", help="Local worker processes (default: one per CPU).", show_default=False)] = None,
    ray: Annotated[Optional[str], typer.Option("--ray", help="Run the deployments as Ray tasks at this address (auto: a running cluster or a local one).", show_default=False)] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Directory for plan.json and plan.png (default: reports/plan/<name>/).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print plan.json on stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="Only the verdict.")] = False,
    async_scheduling: Annotated[Optional[bool], typer.Option("--async-scheduling/--no-async-scheduling", help="vLLM's async scheduling (vllm serve's default, and a workload's) or the synchronous loop in every deployment.", show_default=False)] = None,
    exhaustive: Annotated[bool, typer.Option("--exhaustive", help="Replay every deployment to its end (by default the search skips deployments with more GPUs than a plan already found and stops a replay once a TTFT target is certainly missed; the answer is the same).")] = False,
) -> None:
    """The fewest GPUs for a workload or trace under latency targets: replicas x tp x GPU, each a fleet replay."""
    from kvsim.deployment.plan_view import show_plan

    show_plan(target, model=model, gpus=gpu, tps=tp, replicas=replicas, slo=slo, router=router, timing=timing,
              workers=workers, ray=ray, out=out_option(out), json_out=json_out, quiet=quiet, async_scheduling=async_scheduling, exhaustive=exhaustive)


def _workload_replicas(path: str) -> int:
    """The workload's deployment.replicas, read cheaply (1 when absent or unreadable: the replay reports that)."""
    import yaml

    try:
        raw = yaml.safe_load(open(path))
        return int(raw.get("deployment", {}).get("replicas", 1) or 1)
    except Exception:  # noqa: BLE001  (the replay's own reader names what is wrong)
        return 1


@bench_app.command("kernels")
@user_errors
def bench_kernels(
    model: Annotated[str, typer.Option("--model", "-m", help="Model whose first attention layer gives the shapes.")] = "llama-3.1-8b",
    block_sizes: Annotated[str, typer.Option("--block-sizes", help="Tokens per KV block, comma-separated.")] = "8,16,32,64,128,256",
    batch_sizes: Annotated[Optional[str], typer.Option("--batch-sizes", help="Decode batch sizes (default: 8,64 on CUDA, 2 on CPU).", show_default=False)] = None,
    context_lens: Annotated[Optional[str], typer.Option("--context-lens", help="Tokens per sequence (default: 2048,16384 on CUDA, 256 on CPU).", show_default=False)] = None,
    kv_dtype: Annotated[str, typer.Option("--kv-dtype", help="bf16, fp16 or fp32.")] = "bf16",
    device: Annotated[str, typer.Option("--device", help="cpu, cuda or auto.")] = "auto",
    reps: Annotated[Optional[int], typer.Option("--reps", help="Least repetitions per kernel (default: 10 on CUDA, 3 on CPU).", show_default=False)] = None,
    compile_flex: Annotated[Optional[bool], typer.Option("--compile-flex/--eager-flex", help="Compile FlexAttention (default: on CUDA only).", show_default=False)] = None,
    out: Annotated[str, typer.Option("--out", help="Directory for kernels-<device>.csv.")] = "reports/bench",
) -> None:
    """K/V write and decode-attention kernels, paged vs contiguous, against a copy and a read roofline."""
    from kvsim.bench.kernels_view import show_bench_kernels

    show_bench_kernels(
        model, block_sizes=block_sizes, batch_sizes=batch_sizes, context_lens=context_lens, kv_dtype=kv_dtype,
        device=device, reps=reps, out_dir=out_option(out), compile_flex=compile_flex,
    )


@app.command()
@user_errors
def profile(
    workload: Annotated[str, typer.Argument(help="Workload YAML whose request stream and KV budget to use.")] = "workloads/poisson.yaml",
    reserve: Annotated[str, typer.Option("--reserve", help="Per-request tensor size: max, pow2 or oracle (the flat reserve policies).")] = "max",
    block_size: Annotated[int, typer.Option("--block-size", help="Tokens per block of the paged pool.")] = 16,
    settings: Annotated[str, typer.Option("--settings", help="Allocator settings to run, comma-separated: default, expandable (expandable_segments:True).")] = "default,expandable",
    step_ms: Annotated[float, typer.Option("--step-ms", help="Simulated time of one decode step.")] = 20.0,
    sample_every: Annotated[int, typer.Option("--sample-every", help="Timeline row every N steps (and at every refusal).")] = 50,
    seed: Annotated[Optional[int], typer.Option("--seed", help="Override the workload's seed.")] = None,
    limit: Annotated[Optional[int], typer.Option("--limit", help="Only the first N requests.")] = None,
    snapshot: Annotated[bool, typer.Option("--snapshot", help="Also dump a CUDA memory snapshot per run (for pytorch.org/memory_viz).")] = False,
    out: Annotated[Optional[str], typer.Option("--out", help="Output directory (default: reports/profile/<device>/).")] = None,
) -> None:
    """PyTorch's CUDA caching allocator under the workload: torch.empty per request vs one paged pool (needs CUDA)."""
    from kvsim.profile.run import show_profile

    show_profile(
        workload, reserve=reserve, block_size=block_size, settings=tuple(s.strip() for s in settings.split(",") if s.strip()),
        step_ms=step_ms, sample_every=sample_every, seed=seed, limit=limit, snapshot=snapshot, out_dir=out_option(out),
    )


@app.command("cache-curve")
@user_errors
def cache_curve(
    target: Annotated[str, typer.Argument(help="A trace file (Mooncake JSONL, CSV, JSONL) or a workload YAML.")],
    block_size: Annotated[int, typer.Option("--block-size", help="Tokens per KV block (512 is Mooncake's own).")] = 16,
    capacities: Annotated[Optional[str], typer.Option("--capacities", help="Cache capacities in tokens, e.g. 1e4,1e5,3e6 (default: a log grid).", show_default=False)] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="Adds capacities in bytes from this model's KV bytes per token (default: a workload's model).", show_default=False)] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", "--hardware", help="With --model: mark this GPU's KV budget (utilization 0.9, minus weights).", show_default=False)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object instead of a table.")] = False,
    out: Annotated[Optional[str], typer.Option("--out", help="Directory for the whole curve (cache-curve.csv) and its chart.", show_default=False)] = None,
    cpu_capacities: Annotated[Optional[str], typer.Option("--cpu-capacities", help="Add vLLM's CPU offloading tier (LRU) at these capacities in tokens, e.g. 1e6,1e7: each tier's hit rate at every pair (docs/cpu-tier.md).", show_default=False)] = None,
    cpu_block_size: Annotated[Optional[int], typer.Option("--cpu-block-size", help="Tokens per CPU block, a multiple of --block-size (default: one GPU block, as vLLM's).", show_default=False)] = None,
) -> None:
    """Prefix-cache hit rate of an LRU cache of blocks at every capacity, exact, in one pass over the requests."""
    from kvsim.cache_curve.view import show_cache_curve

    show_cache_curve(target, block_size=block_size, capacities=capacities, model=model, gpu=gpu, as_json=json_out, out=out_option(out),
                     cpu_capacities=cpu_capacities, cpu_block_size=cpu_block_size)


@app.command()
@user_errors
def sweep(
    sweep_file: Annotated[str, typer.Argument(help="Sweep YAML: a base workload, axes by dotted path, optional search (see docs/sweeps.md).")],
    out: Annotated[Optional[str], typer.Option("--out", help="Results directory (default: reports/sweeps/<sweep name>/).")] = None,
    workers: Annotated[Optional[int], typer.Option("--workers", "-j", help="Local worker processes (default: one per CPU).", show_default=False)] = None,
    ray: Annotated[Optional[str], typer.Option("--ray", help="Run on Ray: auto (a running cluster, else a local one) or a cluster ADDRESS.", show_default=False)] = None,
    tensors: Annotated[bool, typer.Option("--tensors/--no-tensors", help="Replay with cache tensors, or accounting only (--no-tensors, the default).")] = False,
    device: Annotated[str, typer.Option("--device", help="With --tensors: cuda, cpu or auto.")] = "auto",
    timing: Annotated[Optional[str], typer.Option("--timing", help="Every replay's step clock: roofline, measured, kernels-db or auto (passed through; default: the sweep file's timing:, else roofline).", show_default=False)] = None,
    csv: Annotated[bool, typer.Option("--csv", help="Also write results.csv next to results.parquet.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar.")] = False,
) -> None:
    """Replay every point of a sweep (a grid of workload fields) into one resumable table; rerun to resume."""
    from kvsim.sweep.view import run_sweep_cli

    run_sweep_cli(sweep_file, out=out_option(out), workers=workers, ray=ray, tensors=tensors, device=device, timing=timing,
                  csv=csv, quiet=quiet)


@app.command()
@user_errors
def conformance(
    workloads: Annotated[Optional[list[str]], typer.Argument(help="Workload files to check instead of the built-in streams (one paged allocator, kv_budget in bytes).", show_default=False, metavar="WORKLOAD.yaml")] = None,
    stream: Annotated[Optional[list[str]], typer.Option("--stream", "-s", help="Run only this stream (repeat for several; default: all).")] = None,
) -> None:
    """Run vLLM 0.33.0's own scheduler beside kvsim's replay on the conformance streams, step by step (fetches the wheel once)."""
    from kvsim.conformance.progress import StderrProgress
    from kvsim.conformance.suite import run_suite

    code = run_suite(stream, echo=typer.echo, progress=StderrProgress(), workloads=workloads)
    if code:
        raise typer.Exit(code)


def app_for(args: list[str]) -> typer.Typer:
    """The app that runs `args`: the whole app, or, where `args` start with a command's (or group's) name, an app
    holding that one command only.

    typer turns every registered command into a click command before it parses anything, reading each
    function's signature and building its options (~25 ms for kvsim's commands besides `size`); a run needs
    the one it names. Usage lines, help and errors of that command are the same either way (the command path
    comes from the context); `kvsim --help`, `--version` and a mistyped name get the whole app, with its list
    and its "did you mean".
    """
    import copy

    from typer.main import get_command_name

    name = args[0] if args else ""
    commands = [c for c in app.registered_commands if (c.name or get_command_name(c.callback.__name__)) == name]
    groups = [g for g in app.registered_groups if g.name == name]
    if not commands and not groups:
        return app
    one = copy.copy(app)  # the same settings and callback (--version), one command
    one.registered_commands, one.registered_groups = commands, groups
    return one


def main() -> None:
    """Console-script entry point.

    Once a command is done, its exit handlers run (Ray's shutdown, multiprocessing's joins, logging) and the
    process leaves without the interpreter's teardown: unloading torch's C++ state took ~0.3 s of the main job's
    8 (scripts/bench_main_job.py), and freeing a replay's objects (its block pool's linked lists are cycles, left
    to a last collection) and unloading numpy and Arrow ~0.1 s of a replay of the Mooncake trace. Every report is
    a closed file by then. Under a profiler or a tracer (`python -m cProfile -m kvsim ...`, coverage) the
    interpreter ends as usual, so that they write what they saw; so it does while a thread it would join still runs.
    """
    try:
        app_for(sys.argv[1:])()  # typer ends in SystemExit
        code: object = 0
    except SystemExit as done:
        code = done.code
    if sys.getprofile() is not None or sys.gettrace() is not None or _threads_left():
        raise SystemExit(code)
    if isinstance(code, str):  # SystemExit("message"): printed, status 1, as the interpreter would
        print(code, file=sys.stderr)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, ValueError):  # a reader gone (`| head`), a stream closed: nothing more to say
            pass
    os._exit(code if isinstance(code, int) else (0 if code is None else 1))


def _threads_left() -> bool:
    """Whether a thread the interpreter would join at its end is still running (an executor's manager, say): then
    the process ends as usual, since `os._exit` skips those joins and the exit callbacks threads registered."""
    import threading

    main_thread = threading.main_thread()
    return any(t is not main_thread and not t.daemon and t.is_alive() for t in threading.enumerate())


if __name__ == "__main__":
    sys.exit(main())
