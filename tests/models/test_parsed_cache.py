"""The data files' parsed cache: a hit is exactly PyYAML's parse, an edited text is a miss, and a missing, corrupt,
foreign or unwritable cache is only a miss (never an error, never a wrong value)."""

from __future__ import annotations

import marshal
import os
import stat
from importlib import resources

import pytest

from kvsim.models import parsed_cache
from kvsim.models.parsed_cache import cache_path, cached_parse
from kvsim.models.yaml_entries import entries_fields, entry_texts, load_yaml, parse_entry


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache folder of this test's; the texts read in-process dropped before and after."""
    monkeypatch.setenv("KVSIM_DATA_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(parsed_cache, "_tables", {})
    return tmp_path / "cache"


def counting_parse():
    """A YAML parse that counts its calls (a miss calls it, a hit does not)."""
    calls = []

    def parse(text):
        calls.append(text)
        return load_yaml(text)

    return parse, calls


def fresh_process():
    """What a new run sees: nothing read in-process yet."""
    parsed_cache._tables.clear()


@pytest.mark.parametrize("name", ["models.yaml", "hardware.yaml", "interconnect.yaml"])
def test_every_shipped_entry_from_the_cache_equals_pyyaml(cache, name):
    text = resources.files("kvsim.models").joinpath(f"data/{name}").read_text()
    file = f"kvsim/models/data/{name}"
    texts = entry_texts(text, name)
    expected = {key: load_yaml(part) for key, part in texts.items()}
    for key, part in texts.items():  # a first run: every entry a miss, parsed and written
        assert parse_entry(key, part, file) == next(iter(expected[key].values()))
    fresh_process()
    parse, calls = counting_parse()
    for key, part in texts.items():  # a later run: every entry a hit, equal to PyYAML's parse
        assert cached_parse(part, file, parse) == expected[key]
    assert calls == []
    assert len(marshal.loads(open(cache_path(file), "rb").read()[len(parsed_cache._MAGIC) + 4:])) == len(texts)


def test_fields_documents_are_cached_too(cache):
    text = resources.files("kvsim.models").joinpath("data/models.yaml").read_text()
    texts = entry_texts(text, "models.yaml")
    first = entries_fields(texts, "hf_id", "aliases", file="models.yaml")
    fresh_process()
    assert entries_fields(texts, "hf_id", "aliases", file="models.yaml") == first == entries_fields(texts, "hf_id", "aliases")
    assert os.path.exists(cache_path("models.yaml"))


def test_an_edited_text_is_a_miss_never_the_old_value(cache):
    parse, calls = counting_parse()
    assert cached_parse("a:\n  x: 1\n", "t.yaml", parse) == {"a": {"x": 1}}
    fresh_process()
    assert cached_parse("a:\n  x: 2\n", "t.yaml", parse) == {"a": {"x": 2}}  # the entry edited since
    assert cached_parse("a:\n  x: 1\n", "t.yaml", parse) == {"a": {"x": 1}}
    assert len(calls) == 2  # the first parse and the edited one; the old text is still a hit


@pytest.mark.parametrize("damage", ["truncated", "flipped", "garbage", "empty", "foreign", "not a dict"])
def test_a_damaged_cache_file_is_a_miss_and_is_rewritten(cache, damage):
    parse, calls = counting_parse()
    cached_parse("a:\n  x: 1\n", "t.yaml", parse)
    path = cache_path("t.yaml")
    blob = open(path, "rb").read()
    damaged = {
        "truncated": blob[:-3],
        "flipped": blob[:-2] + bytes([blob[-2] ^ 0x01]) + blob[-1:],  # a bit of the data: the CRC no longer matches
        "garbage": b"\x00\xff" * 40,
        "empty": b"",
        "foreign": marshal.dumps({"a:\n  x: 1\n": {"a": {"x": 999}}}),  # no header: another program's file
        "not a dict": parsed_cache._MAGIC + (lambda d: __import__("zlib").crc32(d).to_bytes(4, "little") + d)(marshal.dumps([1, 2])),
    }[damage]
    open(path, "wb").write(damaged)
    fresh_process()
    assert cached_parse("a:\n  x: 1\n", "t.yaml", parse) == {"a": {"x": 1}}
    assert len(calls) == 2  # parsed again, not read from the damaged file
    fresh_process()
    assert cached_parse("a:\n  x: 1\n", "t.yaml", parse) == {"a": {"x": 1}}
    assert len(calls) == 2  # the file written afresh


def test_a_read_only_cache_folder_is_read_never_written(cache, monkeypatch):
    parse, calls = counting_parse()
    cached_parse("a: 1\n", "t.yaml", parse)
    os.chmod(cache, stat.S_IRUSR | stat.S_IXUSR)
    if os.geteuid() == 0:  # root writes into a read-only folder: the rename fails as it would for a user

        def refuse(src, dst):
            raise PermissionError(13, "Permission denied", dst)

        monkeypatch.setattr(parsed_cache.os, "replace", refuse)
    try:
        fresh_process()
        assert cached_parse("a: 1\n", "t.yaml", parse) == {"a": 1}  # a hit still
        assert cached_parse("b: 2\n", "t.yaml", parse) == {"b": 2}  # a miss: parsed, not written, no error
        assert len(calls) == 2
        assert sorted(os.listdir(cache)) == [os.path.basename(cache_path("t.yaml"))]  # nothing left aside
    finally:
        os.chmod(cache, stat.S_IRWXU)


def test_a_cache_folder_that_cannot_be_made_is_no_error(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVSIM_DATA_CACHE", str(tmp_path / "file" / "cache"))  # under a file: never a folder
    monkeypatch.setattr(parsed_cache, "_tables", {})
    parse, calls = counting_parse()
    assert cached_parse("a: 1\n", "t.yaml", parse) == {"a": 1}
    assert cached_parse("a: 1\n", "t.yaml", parse) == {"a": 1}
    assert len(calls) == 2
    assert sorted(os.listdir(tmp_path)) == ["file"]


def test_off_reads_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSIM_DATA_CACHE", "off")
    monkeypatch.setattr(parsed_cache, "_tables", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path("t.yaml") is None
    parse, calls = counting_parse()
    assert cached_parse("a: 1\n", "t.yaml", parse) == cached_parse("a: 1\n", "t.yaml", parse) == {"a": 1}
    assert len(calls) == 2 and os.listdir(tmp_path) == []


def test_default_folder_is_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSIM_DATA_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_path("kvsim/models/data/models.yaml").startswith(str(tmp_path / "kvsim" / "data" / "models.yaml."))
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_path("x.yaml").startswith(str(tmp_path / "home" / ".cache" / "kvsim" / "data" / "x.yaml."))


def test_a_value_marshal_cannot_hold_is_parsed_not_cached(cache):
    parse, calls = counting_parse()
    assert str(cached_parse("a: 2024-01-02\n", "t.yaml", parse)["a"]) == "2024-01-02"  # a YAML date
    fresh_process()
    cached_parse("a: 2024-01-02\n", "t.yaml", parse)
    assert len(calls) == 2 and not os.path.exists(cache_path("t.yaml"))


def test_the_cache_is_bounded(cache, monkeypatch):
    monkeypatch.setattr(parsed_cache, "_MAX_TEXTS", 3)
    parse, _ = counting_parse()
    for i in range(5):
        cached_parse(f"a: {i}\n", "t.yaml", parse)
    fresh_process()
    assert len(parsed_cache._read(cache_path("t.yaml"))) <= 3
