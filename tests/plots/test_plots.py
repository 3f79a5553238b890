"""kvsim plot: files written, charts skipped with a note when data is missing, drawn data = report numbers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kvsim.plots import plot_report
from kvsim.plots.report import CATEGORIES, load_report

BUDGET = 2**30  # 1 GiB
ALLOCATORS = ("flat-max", "flat-oracle", "paged-16")


def make_replay_report(directory: Path, *, workload: str = "poisson", allocators=ALLOCATORS, num_steps: int = 120,
                       num_requests: int = 40, with_steps=True, with_requests=True, with_summary=True) -> Path:
    """A small report in the agreed schema, with numbers chosen per allocator so charts can be checked."""
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    steps, requests, summary = [], [], []
    for i, label in enumerate(allocators):
        t = np.arange(num_steps) * 0.05
        rank = i / max(len(allocators) - 1, 1)  # 0 for the first allocator, 1 for the last
        flat = label.startswith("flat")
        token = (0.15 + 0.4 * rank) * BUDGET * (0.5 + 0.5 * np.sin(t) ** 2)
        reservation = 0.1 * BUDGET * np.ones(num_steps) * flat
        internal = (0.02 + 0.3 * (1 - rank)) * BUDGET * np.ones(num_steps)
        external = 0.05 * BUDGET * np.ones(num_steps) * flat
        parts = np.stack([token, reservation, internal, external]).astype(np.int64)
        free = BUDGET - parts.sum(axis=0)
        assert (free >= 0).all()
        frame = pd.DataFrame({
            "allocator": label, "step": np.arange(num_steps), "time_s": t, "step_time_s": 0.05,
            "num_running": (4 + 4 * i + 3 * np.sin(t)).round().astype(int),
            "num_waiting": np.maximum(0, 20 - np.arange(num_steps) // (3 + i)),
            "num_prefill_tokens": 0, "num_decode_tokens": 8,
            "token_states_bytes": parts[0], "reservation_bytes": parts[1],
            "internal_fragmentation_bytes": parts[2], "external_fragmentation_bytes": parts[3],
            "free_bytes": free, "shared_saved_bytes": 0,
            "num_preemptions": (np.arange(num_steps) % 40 == 39).astype(int) * (i == 0),
            "write_us": 1.0, "read_us": 1.0, "attention_us": 1.0,
        })
        steps.append(frame)
        ttft = rng.exponential(0.5 / (i + 1), num_requests)
        ttft[0] = np.nan  # one rejected request per allocator
        requests.append(pd.DataFrame({
            "allocator": label, "request_id": np.arange(num_requests), "arrival_s": 0.0, "ttft_s": ttft,
            "tpot_s": rng.uniform(0.01, 0.03, num_requests) * (i + 1), "num_prompt_tokens": 100, "max_tokens": 50,
        }))
        pct = {f"{c}_pct": float(frame[f"{c}_bytes"].mean() / BUDGET * 100) for c in CATEGORIES}
        summary.append({"allocator": label, **pct, "budget_bytes": BUDGET, "model": "qwen3-0.6b",
                        "workload": workload, "preemptions": int(frame["num_preemptions"].sum())})
    if with_steps:
        pd.concat(steps).to_parquet(directory / "steps.parquet", index=False)
    if with_requests:
        pd.concat(requests).to_csv(directory / "requests.csv", index=False)
    if with_summary:
        pd.DataFrame(summary).to_csv(directory / "summary.csv", index=False)
    (directory / "meta.json").write_text(json.dumps({"seed": 0, "workload": workload}))
    return directory


@pytest.fixture(autouse=True)
def low_dpi():
    """Charts saved at 40 dpi: the same figures, a fraction of the rendering time."""
    import matplotlib

    from kvsim.plots import style  # noqa: F401  (applies kvsim's rcParams first)

    with matplotlib.rc_context({"savefig.dpi": 40}):
        yield


@pytest.fixture
def report_dir(tmp_path):
    return make_replay_report(tmp_path / "poisson")


def draw(report_dir: Path, chart: str):
    from kvsim.plots import _replay_charts

    return dict(_replay_charts())[chart](load_report(report_dir))


def test_every_replay_chart_is_written_as_a_real_image(report_dir):
    notes = []
    paths = plot_report(load_report(report_dir), "png", note=notes.append)
    # block-sizes needs a sweep of paged block sizes; this report has only one
    assert [p.name for p in paths] == ["waste-curves.png", "figure2.png", "timeline.png", "latency.png"]
    assert notes == [f"{report_dir}: skipped block-sizes: summary.csv has fewer than two paged block sizes "
                     "(replay a block-size sweep)"]
    for path in paths:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert path.stat().st_size > 2_000


def make_bench_dir(directory: Path, *, contexts=(512, 2048, 8192), block_sizes=(8, 16, 32, 64)) -> Path:
    """A kernel-bench CSV in `kvsim bench kernels`' columns, times chosen so paged is slower than contiguous."""
    rows = []
    for context in contexts:
        base = dict(device="test-gpu", model="qwen3-0.6b", kv_dtype="bf16", batch_size=8, context_len=context)
        rows.append(dict(base, op="roofline", kernel="copy", block_size=None, status="ok", median_us=context / 100,
                         pct_of_roofline=100.0))
        rows.append(dict(base, op="decode", kernel="sdpa_contiguous", block_size=None, status="ok",
                         median_us=context / 50, pct_of_roofline=80.0))
        for bs in block_sizes:
            rows.append(dict(base, op="write", kernel="index_copy", block_size=bs, status="ok",
                             median_us=context / 40 + 1, pct_of_roofline=60.0 + bs / 8))
            rows.append(dict(base, op="write", kernel="triton", block_size=bs, status="skipped: needs CUDA and triton",
                             median_us=None, pct_of_roofline=None))
            rows.append(dict(base, op="decode", kernel="gather_sdpa", block_size=bs, status="ok",
                             median_us=context / 20 + 64 / bs, pct_of_roofline=40.0 + bs / 4))
    directory.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(directory / "kernels-test-gpu.csv", index=False)
    return directory


# --- chart 2: the paper's Figure 2 -------------------------------------------------------------------------


def bar_segments(fig) -> dict[str, float]:
    """{'<bar>:<category>': height} for every stacked segment, and the same for bottoms under 'bottom:'."""
    ax = fig.axes[0]
    out = {}
    for patch in ax.patches:
        if patch.get_gid():
            out[patch.get_gid()] = patch.get_height()
            out["bottom:" + patch.get_gid()] = patch.get_y()
    return out


def test_figure2_bar_heights_are_summary_percentages(report_dir):
    summary = pd.read_csv(report_dir / "summary.csv")
    segments = bar_segments(draw(report_dir, "figure2"))
    assert len(segments) == 2 * len(ALLOCATORS) * len(CATEGORIES)  # no paper bars for a poisson workload
    for _, row in summary.iterrows():
        bottom = 0.0
        for category in CATEGORIES:
            key = f"{row['allocator']}:{category}"
            assert segments[key] == pytest.approx(row[f"{category}_pct"])
            assert segments["bottom:" + key] == pytest.approx(bottom)
            bottom += row[f"{category}_pct"]
        assert bottom == pytest.approx(100.0)  # the five categories are the whole budget




def test_figure2_thin_segments_figures_do_not_sit_on_each_other(tmp_path):
    """paged-16 of the README's run: reservation 1.0% and internal fragmentation 0.1%, both too thin to hold
    their figure: written beside the bar, one above the other."""
    from kvsim.plots.waste import THIN_LABEL_GAP

    directory = make_replay_report(tmp_path / "r")
    summary = pd.read_csv(directory / "summary.csv")
    thin = {"token_states_pct": 77.9, "reservation_pct": 1.0, "internal_fragmentation_pct": 0.1,
            "external_fragmentation_pct": 0.0, "free_pct": 21.0}
    for column, value in thin.items():
        summary.loc[summary["allocator"] == "paged-16", column] = value
    summary.to_csv(directory / "summary.csv", index=False)
    fig = draw(directory, "figure2")
    ax = fig.axes[0]
    labels = {t.get_gid(): t for t in ax.texts if (t.get_gid() or "").startswith("label:paged-16:")}
    reservation, internal = labels["label:paged-16:reservation"], labels["label:paged-16:internal_fragmentation"]
    assert (reservation.get_text(), internal.get_text()) == ("1.0", "0.1")
    gap = internal.get_position()[1] - reservation.get_position()[1]
    assert gap >= THIN_LABEL_GAP - 1e-9  # 0.55 % apart before: the two figures overprinted
    assert reservation.get_position()[1] == pytest.approx(77.9 + 0.5)  # the lowest stays at its segment


@pytest.mark.parametrize("workload", ["sharegpt-like", "alpaca_like"])
def test_figure2_puts_the_papers_bars_beside_ours_for_paper_like_workloads(tmp_path, workload):
    fig = draw(make_replay_report(tmp_path / "r", workload=workload), "figure2")
    segments = bar_segments(fig)
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks[0] == "flat-max\n≈ Orca (Max)" and ticks[-1] == "vLLM"
    # Kwon et al., SOSP 2023, Figure 2
    assert segments["Orca (Max):token_states"] == pytest.approx(20.4)
    assert segments["Orca (Max):internal_fragmentation"] == pytest.approx(57.3)
    assert segments["Orca (Pow2):external_fragmentation"] == pytest.approx(41.6)
    assert segments["Orca (Oracle):reservation"] == pytest.approx(25.2)
    assert segments["vLLM:token_states"] == pytest.approx(96.3)
    # what the paper does not itemise is not drawn
    assert segments["Orca (Oracle):internal_fragmentation"] == 0.0
    assert segments["vLLM:reservation"] == 0.0
    assert segments["bottom:Orca (Pow2):external_fragmentation"] == pytest.approx(26.8 + 17.9 + 13.6)


# --- chart 1: waste curves ----------------------------------------------------------------------------------


def test_waste_curves_stack_the_steps_bytes_in_gib(report_dir):
    steps = pd.read_parquet(report_dir / "steps.parquet")
    fig = draw(report_dir, "waste-curves")
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_title() for ax in panels] == list(ALLOCATORS)
    assert len({ax.get_ylim() for ax in panels}) == 1  # one scale for every allocator
    for ax in panels:
        rows = steps[steps["allocator"] == ax.get_title()]
        cumulative = rows[[f"{c}_bytes" for c in CATEGORIES]].cumsum(axis=1) / 2**30
        assert len(ax.collections) == len(CATEGORIES)
        for category, collection in zip(CATEGORIES, ax.collections):
            top = collection.get_paths()[0].vertices[:, 1].max()
            assert top == pytest.approx(cumulative[f"{category}_bytes"].max())
        assert ax.collections[-1].get_paths()[0].vertices[:, 1].max() == pytest.approx(1.0)  # the 1 GiB budget


def test_binned_means_keep_each_bins_average():
    from kvsim.plots.waste import binned

    t, v = binned(np.array([0.0, 1.0, 2.0, 3.0]), np.array([[0.0], [2.0], [4.0], [6.0]]), 2)
    assert t.tolist() == [0.75, 2.25]
    assert v[:, 0].tolist() == [1.0, 5.0]
    same_t, same_v = binned(np.array([0.0, 1.0]), np.array([[3.0], [4.0]]), 2)  # few steps: unchanged
    assert same_t.tolist() == [0.0, 1.0] and same_v[:, 0].tolist() == [3.0, 4.0]


# --- chart 3: block sizes -------------------------------------------------------------------------------------


def test_block_size_chart_plots_the_sweep_in_block_size_order(tmp_path):
    labels = ("paged-64", "paged-1", "paged-16", "flat-max", "paged-256")
    report_dir = make_replay_report(tmp_path / "sweep", workload="block-sizes", allocators=labels)
    summary = pd.read_csv(report_dir / "summary.csv").set_index("allocator")
    fig = draw(report_dir, "block-sizes")
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines()}
    for category in ("token_states", "free", "reservation", "internal_fragmentation"):
        assert lines[category].get_xdata().tolist() == [1, 16, 64, 256]
        expected = [summary.loc[f"paged-{b}", f"{category}_pct"] for b in (1, 16, 64, 256)]
        assert lines[category].get_ydata() == pytest.approx(expected)


# --- chart 4: timeline ----------------------------------------------------------------------------------------


def test_timeline_draws_running_and_waiting_and_marks_each_preemption(report_dir):
    steps = pd.read_parquet(report_dir / "steps.parquet")
    fig = draw(report_dir, "timeline")
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines() if line.get_gid()}
    for label in ALLOCATORS:
        rows = steps[steps["allocator"] == label]
        assert lines[f"running:{label}"].get_ydata().tolist() == rows["num_running"].tolist()
        assert lines[f"waiting:{label}"].get_ydata().tolist() == rows["num_waiting"].tolist()
    marked = lines["preemptions:flat-max"]
    preempted = steps[(steps["allocator"] == "flat-max") & (steps["num_preemptions"] > 0)]
    assert marked.get_xdata().tolist() == preempted["time_s"].tolist() and len(preempted) == 3
    assert len(lines["preemptions:paged-16"].get_xdata()) == 0
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "flat-max (peak 7 running, 3 preemptions)" in legend


# --- chart 5: latency -------------------------------------------------------------------------------------------


def test_latency_cdfs_hold_every_finished_request_and_no_rejected_one(report_dir):
    requests = pd.read_csv(report_dir / "requests.csv")
    fig = draw(report_dir, "latency")
    lines = {line.get_gid(): line for ax in fig.axes for line in ax.get_lines() if line.get_gid()}
    for label in ALLOCATORS:
        rows = requests[requests["allocator"] == label]
        ttft = lines[f"ttft_s:{label}"]
        assert ttft.get_xdata().tolist() == sorted(rows["ttft_s"].dropna())  # the rejected request is left out
        assert len(ttft.get_xdata()) == len(rows) - 1
        assert ttft.get_ydata()[-1] == 1.0
        assert lines[f"tpot_s:{label}"].get_xdata() == pytest.approx(sorted(rows["tpot_s"] * 1000))
    p50 = np.percentile(requests.loc[requests["allocator"] == "paged-16", "ttft_s"].dropna(), 50)
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert any(text.startswith(f"paged-16: p50 {p50:.3g} s") for text in legend)


# --- missing data: skipped with a one-line note -------------------------------------------------------------------


@pytest.mark.parametrize(
    "missing, expected_notes",
    [
        ("steps", ["skipped waste-curves: no steps.parquet", "skipped timeline: no steps.parquet"]),
        ("requests", ["skipped latency: no requests.csv"]),
        ("summary", ["skipped figure2: no summary.csv", "skipped block-sizes: no summary.csv"]),
    ],
)
def test_a_chart_without_its_data_is_skipped_with_a_one_line_note(tmp_path, missing, expected_notes):
    report_dir = make_replay_report(tmp_path / "r", **{f"with_{missing}": False})
    notes = []
    paths = plot_report(load_report(report_dir), note=notes.append)
    skipped = [n.split(": ", 1)[1] for n in notes if "block-sizes: summary.csv" not in n]
    assert skipped == expected_notes
    assert all("\n" not in n and n.startswith(str(report_dir)) for n in notes)
    assert all(p.exists() for p in paths) and len(paths) == 5 - len(notes)


def test_a_summary_without_a_category_column_names_it(tmp_path):
    report_dir = make_replay_report(tmp_path / "r")
    pd.read_csv(report_dir / "summary.csv").drop(columns=["free_pct"]).to_csv(report_dir / "summary.csv", index=False)
    notes = []
    plot_report(load_report(report_dir), note=notes.append)
    assert f"{report_dir}: skipped figure2: summary.csv lacks column(s) free_pct" in notes


def test_a_directory_without_reports_is_noted_not_drawn(tmp_path):
    notes = []
    assert plot_report(load_report(tmp_path), note=notes.append) == []
    assert notes == [f"{tmp_path}: skipped: no replay or bench report files"]


def test_same_report_gives_the_same_svg_bytes(report_dir, tmp_path):
    from kvsim.plots.style import save

    first = save(draw(report_dir, "figure2"), tmp_path / "a.svg").read_bytes()
    second = save(draw(report_dir, "figure2"), tmp_path / "b.svg").read_bytes()
    assert first == second and first.lstrip().startswith(b"<?xml")


# --- chart 6: kernel bench ------------------------------------------------------------------------------------------


def test_bench_charts_draw_each_kernels_csv_numbers(tmp_path):
    bench_dir = make_bench_dir(tmp_path / "bench")
    csv = pd.read_csv(bench_dir / "kernels-test-gpu.csv")
    notes = []
    paths = plot_report(load_report(bench_dir), note=notes.append)
    assert [p.name for p in paths] == ["bench-context-kernels-test-gpu.png", "bench-block-size-kernels-test-gpu.png"]
    assert notes == []

    from kvsim.plots import bench

    report = load_report(bench_dir)
    fig = bench.vs_context(report, "kernels-test-gpu")
    lines = {(ax_i, line.get_gid()): line for ax_i, ax in enumerate(fig.axes) for line in ax.get_lines() if line.get_gid()}
    gather = csv[(csv["kernel"] == "gather_sdpa") & (csv["block_size"] == 16)].sort_values("context_len")
    decode_time = next(line for (_, gid), line in lines.items() if gid == "time:gather_sdpa")
    assert decode_time.get_xdata().tolist() == [512, 2048, 8192]
    assert decode_time.get_ydata().tolist() == gather["median_us"].tolist()
    assert not any(gid.endswith(":triton") for _, gid in lines)  # skipped rows are not drawn
    assert next(line for (_, gid), line in lines.items() if gid == "time:sdpa_contiguous").get_linestyle() == "--"

    fig = bench.vs_block_size(report, "kernels-test-gpu")
    pct = next(line for ax in fig.axes for line in ax.get_lines() if line.get_gid() == "pct:gather_sdpa")
    at_8k = csv[(csv["kernel"] == "gather_sdpa") & (csv["context_len"] == 8192)].sort_values("block_size")
    assert pct.get_xdata().tolist() == [8, 16, 32, 64]
    assert pct.get_ydata().tolist() == at_8k["pct_of_roofline"].tolist()


def test_bench_with_one_context_length_skips_the_context_chart(tmp_path):
    bench_dir = make_bench_dir(tmp_path / "bench", contexts=(512,))
    notes = []
    paths = plot_report(load_report(bench_dir), note=notes.append)
    assert [p.name for p in paths] == ["bench-block-size-kernels-test-gpu.png"]
    assert notes == [f"{bench_dir}: skipped bench-context-kernels-test-gpu: kernels-test-gpu.csv has one context "
                     "length (bench with several --context values)"]


# --- chart 7: size -------------------------------------------------------------------------------------------------


def test_size_curves_are_the_sizing_figures():
    from kvsim.plots.size import size_curves

    qwen = size_curves("qwen3-0.6b", max_context=4096)
    # 28 layers x 8 KV heads x head_dim 128 x (K and V) x 2 bytes = 114688 bytes per token, nothing capped
    i = qwen["tokens"].tolist().index(1024)
    assert qwen["capped"][i] == 114688 * 1024
    assert qwen["uncapped"].tolist() == qwen["capped"].tolist()
    assert qwen["tokens"][0] == 16 and qwen["tokens"][-1] == 4096 and qwen["windows"] == []
    # auto, as `kvsim size` takes it: a checkpoint asking for an fp8 KV cache is drawn in fp8 (it drew bf16)
    fp8, bf16 = size_curves("laguna-xs.2-fp8", max_context=4096), size_curves("laguna-xs.2-fp8", kv_dtype="bf16", max_context=4096)
    assert (qwen["kv_dtype"], fp8["kv_dtype"], bf16["kv_dtype"]) == ("bf16", "fp8", "bf16")
    assert fp8["uncapped"][-1] * 2 == bf16["uncapped"][-1]

    gemma = size_curves("gemma-3-27b")
    (window,) = gemma["windows"]
    tokens = gemma["tokens"].tolist()
    assert window in tokens and tokens[-1] == gemma["max_model_len"]
    at, after = tokens.index(window), len(tokens) - 1
    assert gemma["capped"][at] == gemma["uncapped"][at]  # below the window nothing is capped
    # past the window only the full layers grow: the capped slope is lower than the uncapped one
    capped_slope = (gemma["capped"][after] - gemma["capped"][at]) / (tokens[after] - window)
    uncapped_slope = (gemma["uncapped"][after] - gemma["uncapped"][at]) / (tokens[after] - window)
    assert capped_slope < uncapped_slope

    hybrid = size_curves("qwen3-next-80b-a3b")
    assert hybrid["state_bytes"] > 0 and hybrid["capped"][0] > hybrid["state_bytes"]


def test_size_chart_shows_caps_and_states(tmp_path):
    from kvsim.plots import plot_size
    from kvsim.plots.size import bytes_per_sequence, size_curves

    fig = bytes_per_sequence(["qwen3-8b", "gemma-3-27b", "qwen3-next-80b-a3b"])
    gids = {line.get_gid(): line for line in fig.axes[0].get_lines() if line.get_gid()}
    assert "uncapped:gemma-3-27b" in gids and "uncapped:qwen3-8b" not in gids  # dashed only where a cap exists
    state = size_curves("qwen3-next-80b-a3b")["state_bytes"]
    assert gids["state:qwen3-next-80b-a3b"].get_ydata()[0] == state
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_yscale() == "log"
    (path,) = plot_size(["qwen3-0.6b"], "pdf", out_dir=tmp_path)
    assert path == tmp_path / "size-qwen3-0.6b.pdf" and path.read_bytes()[:5] == b"%PDF-"


# --- the command ---------------------------------------------------------------------------------------------------


def test_cli_plots_every_report_under_reports_by_default(cli, tmp_path, monkeypatch):
    make_replay_report(tmp_path / "reports" / "poisson")
    make_bench_dir(tmp_path / "reports" / "bench")
    monkeypatch.chdir(tmp_path)
    result = cli(["plot", "--format", "svg"])
    assert result.exit_code == 0, result.output
    written = result.stdout.split()
    assert "reports/poisson/figure2.svg" in written and "reports/bench/bench-context-kernels-test-gpu.svg" in written
    assert all((tmp_path / p).is_file() for p in written)
    assert "skipped block-sizes" in result.stderr


def test_cli_plot_size_and_errors(cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = cli(["plot", "size", "--model", "qwen3-0.6b", "--model", "llama-3.2-1b"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == "reports/size/size-qwen3-0.6b-vs-llama-3.2-1b.png"
    for args, message in [
        (["plot"], "no reports found"),
        (["plot", "nowhere"], "nowhere: not a report directory"),
        (["plot", "size"], "--model: name at least one model"),
        (["plot", "size", "--model", "no-such-model"], "no-such-model"),
        (["plot", "reports/size", "--format", "gif"], "--format: unknown format 'gif'"),
    ]:
        result = cli(args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr and result.stderr.count("\n") == 1


def test_cli_import_does_not_import_matplotlib():
    code = "import sys, kvsim.cli; sys.exit(any(m.startswith(('matplotlib', 'pandas')) for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_binned_weights_rows_by_their_duration():
    from kvsim.plots.waste import binned

    # one bin over [0, 3]: values 0 (for 1 s) and 6 (for 2 s) and 3 (for 0 s) average to 4
    t, v = binned(np.array([0.0, 1.0, 3.0]), np.array([[0.0], [6.0], [3.0]]), 1, np.array([1.0, 2.0, 0.0]))
    assert t.tolist() == [1.5] and v[:, 0].tolist() == [4.0]


def test_other_commands_csvs_are_not_taken_for_reports(tmp_path):
    profile = tmp_path / "profile"  # what `kvsim profile` writes: its own summary.csv and timeline.csv
    profile.mkdir()
    pd.DataFrame({"setting": ["default"], "admitted": [3]}).to_csv(profile / "summary.csv", index=False)
    pd.DataFrame({"step": [0], "memory_allocated": [1]}).to_csv(profile / "timeline.csv", index=False)
    notes = []
    assert plot_report(load_report(profile), note=notes.append) == []
    assert notes == [f"{profile}: skipped: no replay or bench report files"]


def test_ecdf_of_many_requests_keeps_exact_points_of_the_same_cdf():
    from kvsim.plots.latency import MAX_POINTS, ecdf

    values = np.arange(10 * MAX_POINTS, 0, -1, dtype=float)  # 20000 .. 1, unsorted order
    x, y = ecdf(values)
    assert len(x) == MAX_POINTS and x[0] == 1 and x[-1] == 10 * MAX_POINTS and y[-1] == 1.0
    assert np.allclose(y, x / (10 * MAX_POINTS))  # value k is the k-th smallest of 20000: F(k) = k / 20000
    small_x, small_y = ecdf(np.array([3.0, np.nan, 1.0, 2.0]))
    assert small_x.tolist() == [1.0, 2.0, 3.0] and small_y.tolist() == [1 / 3, 2 / 3, 1.0]


def test_a_chart_that_cannot_be_written_is_one_error_line(report_dir, cli):
    """A directory where the chart goes was an IsADirectoryError traceback."""
    (report_dir / "figure2.png").mkdir()
    result = cli(["plot", str(report_dir)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines()[-1] == f"kvsim: error: {report_dir / 'figure2.png'}: cannot write chart: Is a directory"


# --- reports where some or every request was rejected --------------------------------------------------------------


def reject_everything_in(report_dir: Path, labels) -> None:
    """Rewrite a report as a replay writes it when `labels` rejected every request: no step rows, NaN figures."""
    steps = pd.read_parquet(report_dir / "steps.parquet")
    steps[~steps["allocator"].isin(labels)].to_parquet(report_dir / "steps.parquet", index=False)
    summary = pd.read_csv(report_dir / "summary.csv")
    summary.loc[summary["allocator"].isin(labels), [f"{c}_pct" for c in CATEGORIES]] = np.nan
    summary.to_csv(report_dir / "summary.csv", index=False)
    requests = pd.read_csv(report_dir / "requests.csv")
    requests.loc[requests["allocator"].isin(labels), ["ttft_s", "tpot_s"]] = np.nan
    requests.to_csv(report_dir / "requests.csv", index=False)


def test_an_allocator_that_rejected_everything_is_drawn_empty_and_says_so(report_dir):
    """Its empty step rows made the timeline a ValueError traceback (max of an empty array)."""
    reject_everything_in(report_dir, ["flat-max"])
    notes = []
    paths = plot_report(load_report(report_dir), note=notes.append)
    assert [p.name for p in paths] == ["waste-curves.png", "figure2.png", "timeline.png", "latency.png"]
    timeline = draw(report_dir, "timeline")
    legend = [t.get_text() for t in timeline.legends[0].get_texts()]
    assert legend[0] == "flat-max (no steps: every request rejected)" and legend[2].startswith("paged-16 (peak ")
    waste = draw(report_dir, "waste-curves")
    assert [t.get_text() for t in waste.axes[0].texts] == ["no steps: every request rejected"]
    assert len(waste.legends[0].get_texts()) == len(CATEGORIES)  # taken from a panel that has areas
    segments = bar_segments(draw(report_dir, "figure2"))
    assert not any(key.startswith("flat-max:") for key in segments) and "paged-16:free" in segments


def test_a_report_where_every_request_was_rejected_skips_its_charts(report_dir, recwarn):
    """figure2 drew empty NaN bars and latency empty panels with matplotlib warnings on stderr."""
    reject_everything_in(report_dir, list(ALLOCATORS))
    notes = []
    assert plot_report(load_report(report_dir), note=notes.append) == []
    assert [n.split(": ", 1)[1] for n in notes] == [
        "skipped waste-curves: steps.parquet has no rows",
        "skipped figure2: summary.csv has no time-averaged figures (no allocator ran a step: every request rejected?)",
        "skipped block-sizes: summary.csv has fewer than two paged block sizes (replay a block-size sweep)",
        "skipped timeline: steps.parquet has no rows",
        "skipped latency: requests.csv has no finished request (every one rejected?)",
    ]
    assert not [w for w in recwarn if "legend" in str(w.message)]


def test_latency_legend_percentiles_use_every_request_not_the_thinned_cdf(tmp_path):
    """Beyond MAX_POINTS requests the CDF line is thinned; its legend's p50/p99 must still be summary.csv's."""
    from kvsim.plots.latency import MAX_POINTS

    n = 3 * MAX_POINTS + 7
    report_dir = make_replay_report(tmp_path / "big", num_requests=n)
    requests = pd.read_csv(report_dir / "requests.csv")
    # steep values (each 10% above the last): any point the thinning drops moves a percentile visibly
    steep = np.random.default_rng(1).permutation(np.exp(np.arange(n) / 10))
    requests["ttft_s"] = np.tile(steep, len(ALLOCATORS))
    requests.to_csv(report_dir / "requests.csv", index=False)
    fig = draw(report_dir, "latency")
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    for label, text in zip(ALLOCATORS, legend):
        ttft = requests.loc[requests["allocator"] == label, "ttft_s"].dropna().to_numpy()
        p50, p99 = np.percentile(ttft, [50, 99])
        assert text == f"{label}: p50 {p50:.3g} s, p99 {p99:.3g} s"


def test_an_empty_queue_keeps_a_whole_request_axis(report_dir):
    steps = pd.read_parquet(report_dir / "steps.parquet")
    steps.assign(num_waiting=0).to_parquet(report_dir / "steps.parquet", index=False)
    waiting_ax = draw(report_dir, "timeline").axes[1]
    assert waiting_ax.get_ylim() == (0.0, 1.0)  # was 0 .. 0.055: fractions of a request


@pytest.mark.parametrize("text, kind", [("null", "NoneType"), ("[1, 2]", "list")])
def test_a_meta_json_that_is_not_an_object_is_one_error_line(tmp_path, cli, text, kind):
    """`null` was an AttributeError traceback as soon as a chart asked it for the model."""
    report_dir = make_replay_report(tmp_path / "r", with_summary=False)
    (report_dir / "meta.json").write_text(text)
    result = cli(["plot", str(report_dir)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"kvsim: error: {report_dir / 'meta.json'}: expected a JSON object, got {kind}"]


# --- what a new user found hard to read ---------------------------------------------------------------------


def _make_uneven_report(directory: Path, allocators) -> Path:
    """A report whose first allocator runs ten times longer than the others (as flat-max does on alpaca-like)."""
    make_replay_report(directory, allocators=allocators)
    steps = pd.read_parquet(directory / "steps.parquet")
    long = steps["allocator"] == allocators[0]
    steps.loc[long, "time_s"] *= 10
    steps.loc[long, "step_time_s"] *= 10
    steps.to_parquet(directory / "steps.parquet", index=False)
    return directory


@pytest.mark.parametrize("count", [4, 5])
def test_waste_curves_panels_keep_their_own_time_axis_to_the_end_of_the_last_step(tmp_path, count):
    labels = ("flat-max", "flat-pow2", "flat-oracle", "paged-16", "paged-16+prefix")[:count]
    report = _make_uneven_report(tmp_path / "r", labels)
    steps = pd.read_parquet(report / "steps.parquet")
    fig = draw(report, "waste-curves")
    panels = [ax for ax in fig.axes if ax.get_visible() and ax.get_title()]
    assert [ax.get_title() for ax in panels] == list(labels)
    for ax in panels:
        rows = steps[steps["allocator"] == ax.get_title()]
        end = (rows["time_s"] + rows["step_time_s"]).max()  # the last step's end, not its start
        assert ax.get_xlim()[1] == pytest.approx(end)
        assert ax.collections[0].get_paths()[0].vertices[:, 0].max() == pytest.approx(end)
    visible = [ax for ax in fig.axes if ax.get_visible()]
    empty = [ax for ax in visible if not ax.get_title() and ax.get_legend() is None]
    assert not empty  # 4 panels make a 2x2 grid; 5 leave one slot, and it holds the legend
    assert len(visible) == (4 if count == 4 else 6)


def test_figure2_labels_thin_segments_names_the_papers_run_and_shows_the_sharing_saving(tmp_path):
    report = make_replay_report(tmp_path / "alpaca-like", workload="alpaca-like", allocators=("flat-max", "flat-oracle", "paged-16"))
    summary = pd.read_csv(report / "summary.csv")
    summary["shared_saved_pct"] = [0.0, 0.0, 12.5]
    summary.to_csv(report / "summary.csv", index=False)
    fig = draw(report, "figure2")
    ax = fig.axes[0]
    texts = {t.get_gid(): t.get_text() for t in ax.texts if t.get_gid()}
    pct = summary.set_index("allocator")
    for label in ("flat-max", "flat-oracle", "paged-16"):
        for category in CATEGORIES:
            if pct.loc[label, f"{category}_pct"] >= 0.05:  # every segment of 0.05% or more carries its figure
                assert texts[f"label:{label}:{category}"] == f"{pct.loc[label, f'{category}_pct']:.1f}"
    assert "ShareGPT" in texts["paper-heading"]
    assert any("no Alpaca bars" in t.get_text() for t in fig.texts)
    assert texts["saved:paged-16"] == "sharing saved\n12.5% of budget" and "saved:flat-max" not in texts
    assert all(t.get_rotation() == 25 for t in ax.get_xticklabels())  # two-line labels over few bars: tilted


def test_timeline_keeps_identical_series_apart_and_shows_each_peak(tmp_path):
    report = make_replay_report(tmp_path / "r", num_steps=3000)  # more steps than bins: lines are binned means
    steps = pd.read_parquet(report / "steps.parquet")
    copy = steps[steps["allocator"] == "flat-max"].assign(allocator="flat-max-copy")
    pd.concat([steps, copy]).to_parquet(report / "steps.parquet", index=False)
    summary = pd.read_csv(report / "summary.csv")
    pd.concat([summary, summary.iloc[:1].assign(allocator="flat-max-copy")]).to_csv(report / "summary.csv", index=False)
    fig = draw(report, "timeline")
    running = fig.axes[0]
    lines = {line.get_gid(): line for line in running.get_lines()}
    a, b = lines["running:flat-max"], lines["running:flat-max-copy"]
    assert (a.get_linestyle(), a.get_linewidth()) != (b.get_linestyle(), b.get_linewidth())
    for label in ("flat-max", "paged-16"):
        band = next(c for c in running.collections if c.get_gid() == f"running-peaks:{label}")
        peak = steps.loc[steps["allocator"] == label, "num_running"].max()
        assert band.get_paths()[0].vertices[:, 1].max() == pytest.approx(peak)  # the legend's peak is drawn


def test_latency_labels_its_guides_keeps_tpot_on_a_log_axis_and_shows_one_request(tmp_path):
    report = make_replay_report(tmp_path / "r", num_requests=2)  # one rejected, one finished per allocator
    fig = draw(report, "latency")
    ttft_ax, tpot_ax = fig.axes[:2]
    assert tpot_ax.get_xscale() == "log"  # even when TPOT spans less than 10x
    for ax in (ttft_ax, tpot_ax):
        assert {t.get_text().strip() for t in ax.texts} >= {"p50", "p99"}
        drawn = [line for line in ax.get_lines() if not str(line.get_gid()).startswith("guide:")]
        assert len(drawn) == len(ALLOCATORS) and all(line.get_marker() == "o" for line in drawn)


def test_allocator_colours_never_reuse_a_byte_categorys_colour():
    import matplotlib.colors as mcolors

    from kvsim.plots.style import CATEGORY_COLORS, allocator_colors

    for count in (5, 10, 14):
        labels = [f"paged-{2**i}" for i in range(count - 2)] + ["flat-max", "flat-oracle"]
        for color in allocator_colors(labels).values():
            for category, taken in CATEGORY_COLORS.items():
                distance = np.abs(np.array(mcolors.to_rgb(color)) - np.array(mcolors.to_rgb(taken))).sum()
                assert distance > 0.3, (color, category)


def test_the_subtitle_names_the_loop_a_report_ran_and_says_nothing_where_meta_is_silent(report_dir):
    assert load_report(report_dir).subtitle() == "model qwen3-0.6b · KV budget 1.0 GiB · workload poisson"
    for value, says in ((True, "async scheduling"), (False, "sync scheduling")):
        (report_dir / "meta.json").write_text(json.dumps({"seed": 0, "workload": "poisson", "async_scheduling": value}))
        assert load_report(report_dir).subtitle().endswith(f"· workload poisson · {says}")
