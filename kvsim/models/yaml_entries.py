"""kvsim's data files (the model catalogue, the GPU table) as top-level YAML entries, each parsed when asked for.

PyYAML builds its objects in Python even with the C parser: the 12 KB GPU table took ~10 ms and the 567 KB model
catalogue ~0.1 s, while `kvsim size` needs one entry of each. An entry starts at a line `name:` in the first column
and runs to the next such line; comments and blank lines between entries belong to the entry above.
"""

from __future__ import annotations

import re

from kvsim.models.parsed_cache import cached_parse

# A new top-level line: a newline followed by neither whitespace nor a comment.
_TOP_LEVEL_LINE = re.compile(r"\n(?=[^\s#])")


def load_yaml(text: str, file: str | None = None):
    """`text` parsed by PyYAML's safe loader (its C parser where built); a text of data file `file` from the parsed
    cache where it holds it (kvsim.models.parsed_cache: PyYAML then stays unloaded)."""
    if file is not None:
        return cached_parse(text, file, load_yaml)
    import yaml

    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def entry_texts(text: str, file: str) -> dict[str, str]:
    """Each top-level entry's YAML text by its name, in file order (the file's opening comments dropped)."""
    texts = {}
    for part in _TOP_LEVEL_LINE.split(text):
        name, sep, rest = part.partition(":")
        if not sep or part[:1].isspace() or part.startswith("#"):
            continue  # the file's opening comment block
        assert name.strip() not in texts, f"{file}: entry {name} twice"
        value = rest.split("\n", 1)[0].split("#", 1)[0].strip()  # a comment may follow `name:`
        assert value == "", f"{file}: top-level line {name}: holds a value, not an entry"
        texts[name.strip()] = part
    assert texts, f"{file}: no entries"
    return texts


def parse_entry(name: str, text: str, file: str) -> dict:
    """One entry's fields (its YAML text parsed alone)."""
    parsed = load_yaml(text, file)
    assert isinstance(parsed, dict) and len(parsed) == 1, f"{file}: entry {name}"
    return next(iter(parsed.values()))


def entries_fields(texts: dict[str, str], *fields: str, file: str | None = None) -> dict[str, dict]:
    """Every entry's one-line fields `fields` (`  hf_id: ...`, `  aliases: [...]`) by entry name, parsed as one
    document of those lines only (from data file `file`'s parsed cache where it holds them)."""
    import json

    heads = tuple(f"  {field}:" for field in fields)
    lines = []
    for name, text in texts.items():
        lines.append(f"{json.dumps(name)}:")  # a quoted key: any name is one
        lines += [line.rstrip() for line in text.splitlines() if line.startswith(heads)]
    parsed = load_yaml("\n".join(lines), file) or {}
    return {name: parsed.get(name) or {} for name in texts}
