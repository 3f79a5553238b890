"""kvsim's start-up memory terms beside real vLLM start-up logs (kvsim/conformance/startup_logs/logs.yaml).

Each log states a model, GPU, tp and settings, and the terms vLLM logged; kvsim computes the same terms
(`kvsim.size.startup`) and the available KV memory, as the log's vLLM did (with or without the CUDA graph
estimate subtracted). A log hits when the available KV memory is within 3% or 0.3 GiB of the logged one.
Run: `python3 -m kvsim.conformance.startup_check` (prints the table; exit code 1 under 80% hits).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from importlib import resources

from kvsim.errors import KvsimError

GiB = 1 << 30
TERMS = ("weights", "activation", "non_torch", "cudagraph", "available")
HIT_RELATIVE, HIT_ABSOLUTE = 0.03, 0.3  # within 3% or 0.3 GiB
GOAL = 0.8


@dataclass(frozen=True)
class LogCase:
    """One real start-up log and kvsim's figures for it (GiB)."""

    id: str
    entry: dict
    kvsim: dict  # term -> GiB
    tokens: int | None  # kvsim's "GPU KV cache size"

    @property
    def logged(self) -> dict:
        return self.entry["logged"]

    @property
    def available_error(self) -> float:
        return self.kvsim["available"] - self.logged["available"]

    @property
    def hit(self) -> bool:
        logged = self.logged["available"]
        return abs(self.available_error) <= max(HIT_RELATIVE * abs(logged), HIT_ABSOLUTE)


def load_logs() -> list[dict]:
    """The log entries, as written."""
    import yaml

    text = resources.files("kvsim.conformance").joinpath("startup_logs/logs.yaml").read_text()
    return yaml.safe_load(text)["logs"]


def _model(name: str):
    from kvsim.models.catalogue import resolve_model
    from kvsim.models.hf_config import load_hf_config

    if name.startswith("configs/"):
        path = resources.files("kvsim.conformance").joinpath(f"startup_logs/{name}")
        return load_hf_config(str(path))
    return resolve_model(name)


def kvsim_case(entry: dict) -> LogCase:
    """kvsim's terms for one log entry."""
    from kvsim.models.hardware import get_gpu
    from kvsim.size.report import size_report
    from kvsim.size.startup import StartupSettings, startup_memory
    from kvsim.size.vllm import VllmSettings

    model = _model(entry["model"])
    gpu = get_gpu(entry["gpu"])
    tp = int(entry["tp"])
    settings = StartupSettings(
        gpu_memory_utilization=float(entry["utilization"]),
        max_num_batched_tokens=entry.get("max_num_batched_tokens"),
        max_num_seqs=entry.get("max_num_seqs"),
        estimate_cudagraphs=bool(entry.get("cudagraph_subtracted", True)),
    )
    memory = startup_memory(model, total_memory_bytes=gpu.reported_memory_bytes, tp=tp, settings=settings,
                            device_name=gpu.name, weight_dtype=entry.get("weight_dtype"))  # fmt: skip
    terms = {
        "weights": memory.weights / GiB,
        "activation": memory.activation_peak / GiB,
        "non_torch": memory.non_torch / GiB,
        "cudagraph": memory.cudagraph / GiB,
        "available": memory.available / GiB,
    }
    tokens = None
    if memory.available > 0:
        report = size_report(
            model, kv_dtype=entry.get("kv_dtype", "bf16"), context_tokens=int(entry["max_model_len"]), tp=tp,
            kv_budget_bytes=memory.available,
            settings=VllmSettings(max_num_batched_tokens=settings.max_num_batched_tokens or 8192),
        )  # fmt: skip
        tokens = report.capacity.max_tokens_block_rounded if report.capacity else None
    return LogCase(entry["id"], entry, terms, tokens)


def run() -> list[LogCase]:
    """kvsim beside every log."""
    return [kvsim_case(entry) for entry in load_logs()]


def _cell(case: LogCase, term: str) -> str:
    logged = case.logged.get(term)
    mine = case.kvsim[term]
    if logged is None:
        return f"- / {mine:.2f}"
    return f"{logged:.2f} / {mine:.2f}"


def table(cases: list[LogCase]) -> str:
    """The markdown table docs/startup-memory.md publishes: logged / kvsim per term, GiB."""
    head = "| log | vLLM | tp | weights | activation | non-torch | CUDA graphs (est.) | available KV | error | tokens logged / kvsim |"
    lines = [head, "|" + "---|" * 10]
    for c in cases:
        err = f"{c.available_error:+.2f} ({c.available_error / abs(c.logged['available']) * 100:+.1f}%)" if c.logged["available"] else "-"
        mark = "" if c.hit else " **miss**"
        tok = f"{c.logged['tokens']:,} / {c.tokens:,}" if c.logged.get("tokens") and c.tokens else "-"
        oos = " (out of sample)" if c.entry.get("out_of_sample") else ""
        lines.append(
            f"| [{c.id}]({c.entry['url']}){oos} | {c.entry['vllm_version']} | {c.entry['tp']} | "
            + " | ".join(_cell(c, t) for t in TERMS)
            + f" | {err}{mark} | {tok} |"
        )
    hits = sum(c.hit for c in cases)
    lines.append("")
    lines.append(f"{hits} of {len(cases)} logs within 3% or 0.3 GiB of the logged available KV memory ({hits / len(cases):.0%}).")
    unfitted = [c for c in cases if c.entry.get("out_of_sample")]
    if unfitted:
        lines.append(f"Out of sample (no constant fitted to them): {sum(c.hit for c in unfitted)} of {len(unfitted)} within.")
    for c in cases:
        if not c.hit:
            lines.append(f"- {c.id}: {c.entry.get('note', 'unexplained')}")
    return "\n".join(lines)


def main() -> int:
    try:
        cases = run()
    except KvsimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(cases))
    return 0 if sum(c.hit for c in cases) >= GOAL * len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
