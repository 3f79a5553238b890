"""How `--model` resolves: a local path, the local Hugging Face cache, the catalogue, then the Hub.

A cache folder built in tmp_path stands in for the Hugging Face cache, and a fake `hf_hub_download` for the Hub:
no test touches the network (tests/conftest.py sets HF_HUB_OFFLINE=1 and an empty HF_HUB_CACHE for every test).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from kvsim.errors import KvsimError
from kvsim.models.catalogue import resolve_model
from kvsim.size.sizing import kv_cache_spec

CONFIGS = Path(__file__).parent / "data" / "configs"
QWEN35_9B = CONFIGS / "Qwen--Qwen3.5-9B.json"  # a real config.json (tests/models/data/README.md)
GEMMA2 = CONFIGS / "google--gemma-2-9b-it.json"
REPO_ID = "example-org/Checkpoint-9B"  # a repository id no catalogue knows, holding Qwen3.5-9B's real config
TOTAL_SIZE = 19_316_289_600  # what the index below states; kvsim reads it, never computes it here


def cache_repo(cache: Path, repo_id: str, config: Path, *, index: bool = True, ref: bool = True, rev: str = "abc123") -> Path:
    """models--ORG--NAME/{refs/main, snapshots/<rev>/config.json, model.safetensors.index.json}, as huggingface_hub
    lays it out."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    shutil.copy(config, snapshot / "config.json")
    if index:
        (snapshot / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": TOTAL_SIZE}, "weight_map": {"lm_head.weight": "model-00004-of-00004.safetensors"}})
        )
    if ref:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(rev)
    return snapshot


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    return cache


# --- 1. a local path ---------------------------------------------------------------------------------------------


def test_a_checkpoint_folder_reads_its_config_and_index(tmp_path):
    snapshot = cache_repo(tmp_path, REPO_ID, QWEN35_9B)
    model = resolve_model(str(snapshot))
    assert model.layer_counts == {"linear-state": 24, "full": 8}
    assert model.checkpoint_bytes == TOTAL_SIZE
    assert kv_cache_spec(model).bytes_per_token == 8 * 4 * 256 * 4


def test_a_local_path_comes_before_everything(tmp_path, monkeypatch):
    folder = tmp_path / "qwen3-8b"  # a folder named like a catalogue model: the folder wins
    folder.mkdir()
    shutil.copy(GEMMA2, folder / "config.json")
    monkeypatch.chdir(tmp_path)
    assert resolve_model("qwen3-8b").layer_counts == {"sliding(4096)": 21, "full": 21}


# --- 2. the local Hugging Face cache -----------------------------------------------------------------------------


def test_a_repository_id_in_the_local_cache(hf_cache):
    cache_repo(hf_cache, REPO_ID, QWEN35_9B)
    model = resolve_model(REPO_ID)
    assert (model.name, model.hf_id, model.checkpoint_bytes) == ("Checkpoint-9B", REPO_ID, TOTAL_SIZE)
    assert model.source.startswith(str(hf_cache))
    assert kv_cache_spec(model).state_bytes_per_sequence == 24 * (3 * 8192 * 2 + 32 * 128 * 128 * 4)


def test_the_cache_matches_repository_ids_in_any_case(hf_cache):
    cache_repo(hf_cache, REPO_ID, QWEN35_9B)
    assert resolve_model(REPO_ID.lower()).hf_id == REPO_ID


def test_refs_main_names_the_snapshot(hf_cache):
    cache_repo(hf_cache, REPO_ID, QWEN35_9B, rev="new")
    old = hf_cache / ("models--" + REPO_ID.replace("/", "--")) / "snapshots" / "old"
    old.mkdir()
    shutil.copy(GEMMA2, old / "config.json")
    assert resolve_model(REPO_ID).layer_counts == {"linear-state": 24, "full": 8}


def test_without_refs_the_newest_snapshot_with_a_config(hf_cache):
    cache_repo(hf_cache, REPO_ID, GEMMA2, ref=False, index=False)
    model = resolve_model(REPO_ID)
    assert model.layer_counts == {"sliding(4096)": 21, "full": 21} and model.checkpoint_bytes is None


def test_hf_home_locates_the_cache_without_hf_hub_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    cache_repo(tmp_path / "hf" / "hub", REPO_ID, QWEN35_9B)
    assert resolve_model(REPO_ID).checkpoint_bytes == TOTAL_SIZE


def test_the_cache_comes_before_the_catalogue(hf_cache):
    cache_repo(hf_cache, "Qwen/Qwen3-8B", GEMMA2)  # what is on this machine is what vLLM would serve
    assert resolve_model("Qwen/Qwen3-8B").layer_counts == {"sliding(4096)": 21, "full": 21}
    assert resolve_model("qwen3-8b").layer_counts == {"full": 36}  # a short name is the catalogue's


def test_a_bad_index_names_its_file(hf_cache):
    snapshot = cache_repo(hf_cache, REPO_ID, QWEN35_9B)
    (snapshot / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": "big"}}))
    with pytest.raises(KvsimError, match="metadata.total_size") as err:
        resolve_model(REPO_ID)
    assert "model.safetensors.index.json" in str(err.value)


# --- a legacy ModelOpt checkpoint's hf_quant_config.json ----------------------------------------------------------

LLAMA31_8B = CONFIGS / "meta-llama--Llama-3.1-8B.json"  # 32 layers x 8 KV heads x 128: 131,072 B a token in bf16
# what ModelOpt 0.29 and before wrote beside config.json (nvidia/Llama-3.1-8B-Instruct-FP8 and its kin), with no
# quantization_config in config.json; vLLM 0.33 reads it (transformers_utils/config.py get_config) and takes
# kv_cache_quant_algo FP8 for --kv-cache-dtype auto (utils/torch_utils.py get_kv_cache_quant_algo_string)
LEGACY_FP8 = {"producer": {"name": "modelopt", "version": "0.19.0"},
              "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]}}


def legacy_checkpoint(folder: Path, quant: dict | str = LEGACY_FP8, config: Path = LLAMA31_8B) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(config, folder / "config.json")
    (folder / "hf_quant_config.json").write_text(quant if isinstance(quant, str) else json.dumps(quant))
    return folder


def test_a_checkpoint_folder_with_hf_quant_config_sizes_the_fp8_kv_cache_vllm_takes(tmp_path, cli):
    from kvsim.size.kv_dtype import kv_cache_dtype

    folder = legacy_checkpoint(tmp_path / "Llama-3.1-8B-Instruct-FP8")
    model = resolve_model(str(folder))
    assert model.checkpoint_kv_dtype == "fp8" and kv_cache_dtype("auto", model) == "fp8"
    assert model.weight_config.quantization.method == "modelopt-fp8"  # its weights as vLLM's modelopt method loads them
    assert resolve_model(str(folder / "config.json")).checkpoint_kv_dtype == "fp8"  # the folder's config.json too
    for args in (["--model", str(folder)], ["--config", str(folder / "config.json")]):
        result = cli(["size", *args, "--json"])
        assert result.exit_code == 0, result.output
        assert (json.loads(result.stdout)["kv_dtype"], json.loads(result.stdout)["kv_bytes_per_token"]) == ("fp8", 65536)
    (folder / "hf_quant_config.json").unlink()  # without it: the model's bf16, twice the bytes
    assert json.loads(cli(["size", "--model", str(folder), "--json"]).stdout)["kv_bytes_per_token"] == 131072


def test_hf_quant_config_is_read_only_beside_a_config_json_without_a_quantization_config(tmp_path):
    folder = legacy_checkpoint(tmp_path / "ckpt")
    shutil.copy(LLAMA31_8B, folder / "llama.json")  # a config file of its own name is one file, not a checkpoint
    assert resolve_model(str(folder / "llama.json")).checkpoint_kv_dtype is None
    config = json.loads(LLAMA31_8B.read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, quantization_config={"quant_method": "fp8"})))
    assert resolve_model(str(folder)).checkpoint_kv_dtype is None  # vLLM reads config.json's own first
    # a KV-cache-only export (quant_algo null): no method in vLLM, so auto stays the model's dtype
    kv_only = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}
    model = resolve_model(str(legacy_checkpoint(tmp_path / "kv-only", kv_only)))
    assert model.checkpoint_kv_dtype is None and model.weight_config.quantization is None


@pytest.mark.parametrize(("quant", "says"), [
    ("{not json", "invalid JSON at line 1"),
    ("[1, 2]", "expected a JSON object"),
    # vLLM's _normalize_quantization_config raises for a quant_algo it does not know (INT4_AWQ: TensorRT-LLM's)
    ({"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "INT4_AWQ", "kv_cache_quant_algo": "FP8"}},
     "quantization.quant_algo: vLLM 0.33 cannot load this checkpoint: unknown ModelOpt quant_algo 'INT4_AWQ'"),
])
def test_a_bad_hf_quant_config_names_that_file(tmp_path, quant, says):
    folder = legacy_checkpoint(tmp_path / "ckpt", quant)
    with pytest.raises(KvsimError) as err:
        resolve_model(str(folder))
    assert str(err.value).startswith(f"{folder / 'hf_quant_config.json'}: ") and says in str(err.value)


def test_a_cached_checkpoint_reads_its_hf_quant_config(hf_cache):
    snapshot = cache_repo(hf_cache, REPO_ID, LLAMA31_8B)
    assert resolve_model(REPO_ID).checkpoint_kv_dtype is None
    (snapshot / "hf_quant_config.json").write_text(json.dumps(LEGACY_FP8))
    assert resolve_model(REPO_ID).checkpoint_kv_dtype == "fp8"


# --- 3. the catalogue, 4. the Hub --------------------------------------------------------------------------------


def _response(status: int):
    """The little of an HTTP response huggingface_hub's errors read."""
    from types import SimpleNamespace

    return SimpleNamespace(headers={}, status_code=status, request=None, url="https://huggingface.co")


class FakeHub:
    """hf_hub_download over a folder of files: records each call; raises `error` when one is given."""

    def __init__(self, files: dict[str, Path], tmp: Path, error: Exception | None = None):
        self.files, self.tmp, self.error, self.calls = files, tmp, error, []

    def __call__(self, repo_id, filename, **kwargs):
        from huggingface_hub import errors

        self.calls.append((repo_id, filename))
        if self.error is not None:
            raise self.error
        if filename not in self.files:
            raise errors.RemoteEntryNotFoundError(f"404 {filename}", response=_response(404))
        out = self.tmp / repo_id.replace("/", "--") / filename
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(self.files[filename], out)
        return str(out)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """Install a FakeHub as huggingface_hub.hf_hub_download, with HF_HUB_OFFLINE unset."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def install(files: dict[str, Path], error: Exception | None = None) -> FakeHub:
        fake = FakeHub(files, tmp_path / "downloads", error)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake)
        return fake

    return install


def test_the_hub_fetches_config_index_and_hf_quant_config_only(hub, tmp_path):
    # hf_quant_config.json is asked for where config.json states no quantization_config (here a 404: none)
    index = tmp_path / "index.json"
    index.write_text(json.dumps({"metadata": {"total_size": TOTAL_SIZE}}))
    fake = hub({"config.json": QWEN35_9B, "model.safetensors.index.json": index})
    model = resolve_model(REPO_ID)
    assert fake.calls == [(REPO_ID, "config.json"), (REPO_ID, "model.safetensors.index.json"), (REPO_ID, "hf_quant_config.json")]
    assert (model.hf_id, model.checkpoint_bytes) == (REPO_ID, TOTAL_SIZE)
    assert model.layer_counts == {"linear-state": 24, "full": 8}


def test_a_hub_checkpoint_without_an_index_has_no_checkpoint_bytes(hub):
    hub({"config.json": GEMMA2})
    assert resolve_model(REPO_ID).checkpoint_bytes is None


def test_a_hub_checkpoint_with_hf_quant_config_sizes_the_fp8_kv_cache(hub, tmp_path):
    quant = tmp_path / "hf_quant_config.json"
    quant.write_text(json.dumps(LEGACY_FP8))
    fake = hub({"config.json": LLAMA31_8B, "hf_quant_config.json": quant})
    assert resolve_model(REPO_ID).checkpoint_kv_dtype == "fp8"
    assert fake.calls == [(REPO_ID, "config.json"), (REPO_ID, "model.safetensors.index.json"), (REPO_ID, "hf_quant_config.json")]
    # a config.json with its own quantization_config: vLLM reads no other file, nor does kvsim ask for one
    fp8 = tmp_path / "fp8.json"
    fp8.write_text(json.dumps(dict(json.loads(LLAMA31_8B.read_text()), quantization_config={"quant_method": "fp8"})))
    fake = hub({"config.json": fp8, "hf_quant_config.json": quant})
    assert resolve_model("example-org/Other-8B").checkpoint_kv_dtype is None
    assert [f for _, f in fake.calls] == ["config.json", "model.safetensors.index.json"]


def test_a_catalogue_model_never_reaches_the_hub(hub):
    fake = hub({}, error=AssertionError("the Hub was asked"))
    assert resolve_model("Qwen/Qwen3-8B").name == "qwen3-8b"
    assert resolve_model("openai/gpt-oss-20b").layer_counts == {"sliding(128)": 12, "full": 12}
    assert fake.calls == []


def _hub_errors():
    errors = pytest.importorskip("huggingface_hub").errors
    return [
        (errors.GatedRepoError("403 gated", response=_response(403)), "gated repository.*HF_TOKEN"),
        (errors.RepositoryNotFoundError("404", response=_response(404)), "no such repository"),
        (errors.LocalEntryNotFoundError("offline"), r"cannot reach .*\(HF_HUB_OFFLINE=1"),
        (ConnectionError("Name or service not known"), "cannot reach the Hugging Face Hub"),
    ]


@pytest.mark.parametrize("case", range(4))
def test_a_hub_error_is_one_line_naming_the_repository(hub, case):
    error, message = _hub_errors()[case]
    hub({}, error=error)
    with pytest.raises(KvsimError, match=message) as err:
        resolve_model(REPO_ID)
    assert REPO_ID in str(err.value) and "\n" not in str(err.value) and err.value.field == "--model"


def test_offline_an_unknown_id_says_where_kvsim_looked_and_what_to_do(hf_cache):
    with pytest.raises(KvsimError) as err:
        resolve_model(REPO_ID)
    text = str(err.value)
    for words in (str(hf_cache), "HF_HUB_OFFLINE", "kvsim models", "config.json", "not a local path"):
        assert words in text
    assert "\n" not in text


def test_an_unknown_short_name_offers_close_catalogue_names():
    with pytest.raises(KvsimError, match="did you mean qwen3-8b"):
        resolve_model("qwen3-8")


def test_huggingface_hub_is_imported_only_by_the_hub_step(hf_cache):
    cache_repo(hf_cache, REPO_ID, QWEN35_9B)
    code = (
        "import sys; from kvsim.models.catalogue import resolve_model; "
        f"resolve_model('qwen3-8b'); resolve_model('Qwen/Qwen3-8B'); resolve_model({REPO_ID!r}); "
        "assert 'huggingface_hub' not in sys.modules, 'imported'"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-2000:]


# --- bad input: a binary file or a weights file given as a config --------------------------------------------------


def test_a_binary_file_as_config_is_one_line(cli, tmp_path):
    binary = tmp_path / "ls"
    binary.write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))
    result = cli(["size", "--config", str(binary)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == [f"kvsim: error: {binary}: not a config.json: binary content, not JSON text"]


def test_a_weights_file_as_model_is_one_line(cli, tmp_path):
    weights = tmp_path / "model-00001-of-00004.safetensors"
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    result = cli(["size", "--model", str(weights)])
    assert result.exit_code == 2
    assert len(result.output.strip().splitlines()) == 1
    assert str(weights) in result.output and "weights file" in result.output


def test_a_weights_file_name_never_reaches_the_hub(cli):
    result = cli(["size", "--model", "my/model-00001-of-00004.safetensors"])  # looks like ORG/NAME, but a file name
    assert result.exit_code == 2 and "weights file" in result.output and "Hub" not in result.output


def test_a_workload_model_pointing_at_a_weights_file_is_one_line(cli, tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    workload = tmp_path / "w.yaml"
    alpaca = (REPO / "workloads" / "alpaca-like.yaml").read_text()
    workload.write_text(alpaca.replace("model: opt-13b", "model: ckpt/model.safetensors"))
    result = cli(["replay", str(workload), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "weights file" in lines[0] and str(tmp_path / "ckpt" / "model.safetensors") in lines[0]


def test_a_cached_catalogue_model_keeps_the_catalogues_parameter_count(hf_cache):
    cache_repo(hf_cache, "Qwen/Qwen3.5-9B", QWEN35_9B)  # a hybrid: no parameter count from its config.json
    model = resolve_model("Qwen/Qwen3.5-9B")
    assert model.source.startswith(str(hf_cache)) and model.checkpoint_bytes == TOTAL_SIZE
    assert model.num_params == resolve_model("qwen3.5-9b").num_params == 9_000_000_000
    assert "qwen3.5-9b" in model.params_source
