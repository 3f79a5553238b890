"""Import vLLM's own modules, unmodified, from the extracted wheel, with stubs for what they do not need.

A meta-path finder serves `vllm.*` from the cache and stub modules for an allow-list of names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import logging
import os
import sys
import threading
import types
from pathlib import Path

from kvsim.errors import KvsimError

# Third-party packages vLLM's scheduler path imports at module level but never calls on it. Stubbed
# even where installed, so the modules behave the same on every machine; they are stubs only while
# vLLM's modules load, then the process's own packages (or their absence) come back.
STUB_THIRD_PARTY = frozenset({
    "cbor2", "xxhash", "transformers", "huggingface_hub", "safetensors", "cloudpickle", "zmq", "uvloop",
    "cpuinfo", "psutil", "requests", "prometheus_client", "regex",
})

# Real packages the loaded vLLM modules use: torch, numpy, pydantic (vllm.config's dataclasses),
# msgspec (SamplingParams, EngineCoreOutput), packaging (torch version checks).
REQUIRED = ("torch", "numpy", "pydantic", "msgspec", "packaging")

# vLLM packages outside the scheduler and the KV cache manager: served as stubs, with their submodules.
STUB_VLLM = (
    "vllm.model_executor", "vllm.distributed", "vllm.multimodal", "vllm.v1.structured_output.utils",
    "vllm.parser", "vllm.entrypoints", "vllm.renderers",
)

# Packages whose `__init__` pulls in the whole engine: a stub module, but its submodules load for
# real (`vllm.config.scheduler`, `vllm.config.cache`), so `from vllm.config import VllmConfig` is a stub.
# `vllm.v1.structured_output.request` must be real: a stub's answer would mark every request as waiting
# for a grammar. `vllm.distributed` and `vllm.distributed.kv_transfer` are hollow so that the KV connectors
# (REAL_VLLM) load for real while the rest of `vllm.distributed` stays a stub.
HOLLOW_VLLM = ("vllm.config", "vllm.v1.structured_output", "vllm.distributed", "vllm.distributed.kv_transfer")

# Packages inside a stubbed one that load for real: the KV connectors (their factory, the base class and
# vLLM's OffloadingConnector with its scheduler side), which the scheduler builds from `kv_transfer_config`.
REAL_VLLM = ("vllm.distributed.kv_transfer.kv_connector",)

# Every stub attribute looked up or called, by qualified name: what the loaded code touched of the stubs
# (a scheduler run that calls one is worth a look).
stub_uses: dict[str, int] = {}

_lock = threading.RLock()


class VllmImportError(KvsimError):
    """vLLM's modules could not be imported (a required package missing, or a stub too thin)."""


class _StubMeta(type):
    """Metaclass of stub classes: any attribute is another stub, subscripting and `|` give the class."""

    def __getattr__(cls, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(_used(f"{cls.__qualname__}.{name}"))

    def __getitem__(cls, item):
        return cls

    def __or__(cls, other):
        return cls

    def __ror__(cls, other):
        return cls

    def __call__(cls, *args, **kwargs):
        # A stub used as a decorator (`@stub`, `@stub(...)`) hands back what it decorates.
        if cls.__dict__.get("_kvsim_stub"):
            _used(f"{cls.__qualname__}()")
            if _decorates(args, kwargs):
                return args[0]
        return super().__call__(*args, **kwargs)


class _Stub(metaclass=_StubMeta):
    """An instance that accepts any construction, attribute access and call."""

    def __init__(self, *args, **kwargs):
        pass

    def __init_subclass__(cls, **kwargs):
        pass

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _stub_class(_used(f"{type(self).__qualname__}().{name}"))()

    def __call__(self, *args, **kwargs):
        _used(f"{type(self).__qualname__}()()")
        if _decorates(args, kwargs):
            return args[0]
        return _stub_class(f"{type(self).__qualname__}()()")()

    def __bool__(self) -> bool:
        return False


def _used(name: str) -> str:
    stub_uses[name] = stub_uses.get(name, 0) + 1
    return name


def _decorates(args: tuple, kwargs: dict) -> bool:
    return len(args) == 1 and not kwargs and callable(args[0])


def _stub_class(name: str) -> type:
    return _StubMeta(name.rsplit(".", 1)[-1], (_Stub,), {"_kvsim_stub": True, "__qualname__": name})


class StubModule(types.ModuleType):
    """A module whose every public attribute is a stub class (created on first access, then kept)."""

    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _stub_class(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _StubLoader(importlib.abc.Loader):
    def create_module(self, spec):
        module = StubModule(spec.name)
        module.__path__ = list(spec.submodule_search_locations or [])
        return module

    def exec_module(self, module):
        pass


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class _VllmFinder(importlib.abc.MetaPathFinder):
    """Serves `vllm` from `root`, stubs for STUB_VLLM/HOLLOW_VLLM and, while loading, STUB_THIRD_PARTY."""

    def __init__(self, root: Path):
        self.root = root
        self.stubbing_third_party = False

    def find_spec(self, name, path, target=None):
        top = name.partition(".")[0]
        if top == "vllm":
            if _under(name, REAL_VLLM):
                return importlib.machinery.PathFinder.find_spec(name, path or [str(self.root)])
            if _under(name, STUB_VLLM) and name not in HOLLOW_VLLM:
                return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
            if name in HOLLOW_VLLM:
                spec = importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
                spec.submodule_search_locations = [str(self.root.joinpath(*name.split(".")))]
                return spec
            return importlib.machinery.PathFinder.find_spec(name, path or [str(self.root)])
        if self.stubbing_third_party and top in STUB_THIRD_PARTY:
            return importlib.machinery.ModuleSpec(name, _StubLoader(), is_package=True)
        return None


_finder: _VllmFinder | None = None


def install(root: Path | None = None) -> _VllmFinder:
    """Put the finder first on `sys.meta_path` (once per process), serving vLLM from `root`.

    `root` defaults to the cache that `vllm_wheel.vllm_source_root()` fills (fetching the wheel).
    """
    global _finder
    with _lock:
        if _finder is None:
            for req in REQUIRED:
                try:
                    importlib.import_module(req)
                except ImportError as exc:
                    raise VllmImportError(f"vLLM's modules need the package {req!r} ({exc}): install kvsim's "
                                          "conformance extra, pip install -e '.[conformance]' in a clone "
                                          "(pip install 'kvsim[conformance]' otherwise)") from None
            if root is None:
                from kvsim.conformance.vllm_wheel import vllm_source_root

                root = vllm_source_root()
            loaded = [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]
            if loaded:
                raise VllmImportError(f"a vllm module is already imported ({loaded[0]}); cannot load vLLM from {root}")
            os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
            logging.getLogger("vllm").setLevel(logging.ERROR)  # quiet: no notes on platform detection
            _finder = _VllmFinder(Path(root))
            sys.meta_path.insert(0, _finder)
        elif root is not None and Path(root) != _finder.root:
            raise VllmImportError(f"vLLM is already loaded from {_finder.root}, not {root}")
        return _finder


def import_vllm(name: str, root: Path | None = None) -> types.ModuleType:
    """Import vLLM's module `name` (e.g. "vllm.v1.core.sched.scheduler") unmodified from the cache."""
    if not (name == "vllm" or name.startswith("vllm.")):
        raise ValueError(f"not a vllm module: {name}")
    with _lock:
        finder = install(root)
        saved = {k: v for k, v in sys.modules.items() if k.partition(".")[0] in STUB_THIRD_PARTY}
        finder.stubbing_third_party = True
        try:
            return importlib.import_module(name)
        except ImportError as exc:
            raise VllmImportError(f"importing {name} from {finder.root}: {exc}") from exc
        finally:
            finder.stubbing_third_party = False
            for key in [k for k in sys.modules if k.partition(".")[0] in STUB_THIRD_PARTY]:
                if isinstance(sys.modules[key], StubModule):
                    del sys.modules[key]
            sys.modules.update(saved)
