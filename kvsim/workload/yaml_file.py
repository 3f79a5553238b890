"""The YAML of workload and sweep files, parsed strictly: a key given twice in one mapping is an error.

PyYAML keeps the last of two equal keys silently (`count: 500` then `count: 5000` runs 5,000 requests); here it
is a one-line error naming the key and its line, as every other mistake in these files is. Merge keys (`<<`)
still override as YAML defines."""

from __future__ import annotations

from typing import Any

import yaml

from kvsim.errors import KvsimError

_Base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE = "tag:yaml.org,2002:merge"


class _StrictLoader(_Base):  # type: ignore[misc, valid-type]
    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == _MERGE:
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:  # an unhashable key: the constructor's own error follows
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_yaml(data: bytes | str, *, source: str) -> Any:
    """The document in `data`; a KvsimError naming `source`, the problem and its line if it is not valid YAML
    or gives a key twice in one mapping."""
    try:
        return yaml.load(data, Loader=_StrictLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise KvsimError(f"not valid YAML: {problem}{where}", source=source) from None
