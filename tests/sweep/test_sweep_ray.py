"""The Ray backend on a real local Ray instance (2 CPUs): the same table as the local backend, byte for byte.

Skipped where ray is not installed (`pip install 'kvsim[ray]'`; the test extra has it). Starting the instance
takes most of this file's time (about 10 s on a loaded 2-core machine); the sweeps are kept to a few tasks.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from kvsim.sweep.view import run_sweep
from tests.sweep.test_sweep import make_sweep

ray = pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    """One local instance for the module: the runner uses a session this process already holds."""
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


def test_ray_writes_the_local_backends_table_byte_for_byte(tmp_path, local_ray):
    path = make_sweep(tmp_path, axes={"kv_budget": ["1KiB", "128MiB"], "requests.arrival.rate": [10, 40]})
    local = run_sweep(path, out=tmp_path / "local", workers=2, csv=True)
    on_ray = run_sweep(path, out=tmp_path / "ray", ray="auto", csv=True)
    assert (on_ray.num_run, on_ray.num_failed) == (8, 4)  # 1 KiB holds no block: those rows carry the error
    assert [p.read_bytes() for p in on_ray.paths] == [p.read_bytes() for p in local.paths]


def test_ray_capacity_search_matches_the_local_one(tmp_path, local_ray):
    search = {"axis": "requests.arrival.rate", "lo": 4, "hi": 120, "step": 4, "target": {"ttft_p99_s": 0.1}}
    path = make_sweep(tmp_path, axes={"kv_budget": ["64MiB"]}, search=search)
    local = run_sweep(path, out=tmp_path / "local", workers=1)
    on_ray = run_sweep(path, out=tmp_path / "ray", ray="auto")
    assert on_ray.paths[0].read_bytes() == local.paths[0].read_bytes()
    table = pd.read_parquet(on_ray.paths[0])
    assert list(table["capacity_status"]) == ["below lo", "found"]  # flat-max: no 2048-token slab in 64 MiB and table["error"].isna().all()


@pytest.mark.parametrize("name", ["block-size-x-budget", "rate-x-allocator-capacity", "model-x-gpu-x-dtype"])
def test_shipped_sweeps_give_the_same_table_locally_and_on_ray(tmp_path, local_ray, name):
    """Each shipped sweep as shipped, cut to 30 requests per replay to keep the shared machine free."""
    import yaml

    fields = yaml.safe_load((REPO / "workloads" / "sweeps" / f"{name}.yaml").read_text())
    fields["base"] = str(REPO / "workloads" / "sweeps" / fields["base"])
    fields["set"] = {**fields.get("set", {}), "requests.count": 30}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(fields, sort_keys=False))
    local = run_sweep(path, out=tmp_path / "local", workers=2)
    on_ray = run_sweep(path, out=tmp_path / "ray", ray="auto")
    assert on_ray.num_failed == 0 and on_ray.num_rows == local.num_rows > 0
    assert on_ray.paths[0].read_bytes() == local.paths[0].read_bytes()
