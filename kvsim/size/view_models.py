"""`kvsim models`: the catalogue as a rich table (the essential columns on narrow terminals) or --json."""

from __future__ import annotations

import json

from rich import box
from rich.console import Console
from rich.table import Table


def _short_kind(label: str) -> str:
    """A layer kind label for narrow terminals: 'sliding(4096)' -> 'swa(4096)', 'linear-state' -> 'state'."""
    return label.replace("linear-state", "state").replace("sliding", "swa").replace("chunked", "chunk")


def show_models(*, as_json: bool = False) -> None:
    """The catalogue: name, HF id, layers by kind, KV heads, head_dim, KV bytes/token in bf16, params."""
    from kvsim.models.catalogue import catalogue_models
    from kvsim.size.sizing import kv_cache_spec

    rows = []
    for model in catalogue_models():
        spec = kv_cache_spec(model)
        rows.append(
            {
                "name": model.name,
                "hf_id": model.hf_id,
                "layers": model.layer_counts,
                "num_kv_heads": model.num_kv_heads,
                "head_dim": model.head_dim,
                "kv_bytes_per_token_bf16": spec.bytes_per_token,
                "state_bytes_per_sequence_bf16": spec.state_bytes_per_sequence,
                "max_model_len": model.max_model_len,
                "num_params": model.num_params,
            }
        )
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    console = Console()
    wide = console.width >= 150  # narrow terminals get the essential columns only
    table = Table(title="kvsim model catalogue (KV per token in bf16, tp=1)", title_justify="left", box=box.SIMPLE_HEAD, show_edge=False)
    cols = ["name", "hf id", "layers", "KV heads", "head dim", "KV B/token", "state B/seq", "max len", "params"]
    if not wide:
        cols = ["name", "layers", "KV HxD", "B/token", "params"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("name", "hf id", "layers") else "right", no_wrap=True)
    for r in rows:
        cells = {
            "name": r["name"],
            "hf id": r["hf_id"],
            "layers": (" + " if wide else "+").join(f"{n} {k if wide else _short_kind(k)}" for k, n in r["layers"].items()),
            "KV heads": str(r["num_kv_heads"]),
            "head dim": str(r["head_dim"]),
            "KV HxD": f"{r['num_kv_heads']}x{r['head_dim']}",
            "KV B/token": f"{r['kv_bytes_per_token_bf16']:,}",
            "B/token": f"{r['kv_bytes_per_token_bf16']:,}",
            "state B/seq": f"{r['state_bytes_per_sequence_bf16']:,}" if r["state_bytes_per_sequence_bf16"] else "-",
            "max len": f"{r['max_model_len']:,}",
            "params": f"{r['num_params'] / 1e9:.{0 if r['num_params'] >= 1e11 else 1}f}B",
        }
        table.add_row(*(cells[c] for c in cols))
    console.print(table)
