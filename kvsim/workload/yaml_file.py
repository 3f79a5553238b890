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
    def construct_document(self, node):
        # every mapping as written, before construction flattens merge keys into the nodes it merges into
        self._check_keys(node, set())
        return super().construct_document(node)

    def _check_keys(self, node, seen: set) -> None:
        if id(node) in seen:  # an alias: its node was checked where its anchor is
            return
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            keys = set()
            for key_node, value_node in node.value:
                if key_node.tag != _MERGE and isinstance(key_node, yaml.ScalarNode):
                    key = self.construct_object(key_node)
                    try:
                        if key in keys:
                            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
                        keys.add(key)
                    except TypeError:  # an unhashable key: the constructor's own error follows
                        pass
                self._check_keys(value_node, seen)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                self._check_keys(item, seen)


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
