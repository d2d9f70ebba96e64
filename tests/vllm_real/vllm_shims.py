"""What vLLM's source tree needs to import under Debian 12's Python (torch 1.13, no
msgspec, transformers, pyzmq, ...), and nothing more. Used by real_engine.setup_vllm
in the engine processes only; the test process never imports vLLM.

- Absent third-party packages (real_engine.STUBBED_PACKAGES): placeholder modules
  whose every attribute is a placeholder class (instances are falsy, calls return
  themselves), so that `from x import Y`, subclassing and annotations work; nothing
  on the tested paths calls them. `importlib.metadata` reports transformers 5.0.0
  (vLLM refuses v4 at import). msgspec is replaced by _msgspec_lite instead.
- The `vllm` distribution metadata: version "0.0.0+cpu", what a CPU build of the tree
  reports, so that vLLM selects its own CpuPlatform.
- torch 2 names on torch 1.13: `torch.library.infer_schema` (an annotation-based
  subset), `Library(..., "FRAGMENT")` (inert: its ops become their Python functions
  under torch.ops.<ns>, with `.default` and overload attributes), `torch.Tag` members,
  the float8/float4/uint16-64 dtypes (stand-ins: float64, uint8, int16-64),
  `c10d._get_default_timeout`, the CPU feature probes `torch.cpu._is_avx512*` (False),
  `init_process_group`/`new_group` accepting `timeout=None` (and `device_id`).
- Any other torch attribute or submodule that vLLM (not torch itself) asks for and
  torch 1.13 lacks becomes a placeholder, recorded in TORCH_FILLED; the engines
  report that list and the test prints it.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.metadata
import sys
import types

STUBBED_PACKAGES: set[str] = set()


class _Anything(types.ModuleType):
    """A module whose every attribute is a permissive placeholder."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _PlaceholderMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__qualname__}.{name}")


def _placeholder(qualname: str):
    class _P(metaclass=_PlaceholderMeta):
        __qualname__ = qualname
        __name__ = qualname.rsplit(".", 1)[-1]

        def __init__(self, *a, **k):
            pass

        def __class_getitem__(cls, item):
            return cls

        def __call__(self, *a, **k):
            return self

        def __bool__(self):  # a feature probe through a placeholder answers "not available"
            return False

    return _P


# The version a stubbed distribution claims (what vLLM's import-time checks require).
# vllm: the source tree counts as a CPU build (what `VLLM_TARGET_DEVICE=cpu pip
# install` of it would report), so that vLLM picks its own CpuPlatform.
STUB_VERSIONS = {"transformers": "5.0.0", "vllm": "0.0.0+cpu"}


class _StubDistribution(importlib.metadata.Distribution):
    def __init__(self, name):
        self._name = name

    def read_text(self, filename):
        if filename in ("METADATA", "PKG-INFO"):
            return f"Metadata-Version: 2.1\nName: {self._name}\nVersion: {STUB_VERSIONS.get(self._name, '0.0.0')}\n"
        return None

    def locate_file(self, path):
        return None


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names, metadata_only=()):
        self.names = set(names)
        self.metadata_only = set(metadata_only)

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.split(".")[0]
        if top in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        name = (context.name or "").replace("-", "_")
        if name in self.names or name in self.metadata_only:
            return iter([_StubDistribution(name)])
        return iter(())

    def create_module(self, spec):
        m = _Anything(spec.name)
        m.__path__ = []
        return m

    def exec_module(self, module):
        STUBBED_PACKAGES.add(module.__name__)


TORCH_FILLED: list[str] = []


class _PyOp:
    """A custom op of an inert library: its Python function, with `.default`."""

    def __init__(self, name, fn):
        self.__name__ = self._name = name
        self._fn = fn
        self.default = self

    def __call__(self, *args, **kwargs):
        return self._fn(*args, **kwargs)


def _fill_getattr(module):
    def __getattr__(name):
        if name.startswith("__"):
            raise AttributeError(name)
        if getattr(module, "__path__", None) is not None:
            try:
                if importlib.machinery.PathFinder.find_spec(f"{module.__name__}.{name}", module.__path__):
                    return importlib.import_module(f"{module.__name__}.{name}")
            except ImportError:
                pass
        frame = sys._getframe(1)
        while frame is not None and frame.f_globals.get("__name__", "").startswith("importlib"):
            frame = frame.f_back
        caller = frame.f_globals.get("__name__", "") if frame is not None else ""
        if caller == "torch" or caller.startswith("torch."):
            raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
        value = _placeholder(f"{module.__name__}.{name}")
        TORCH_FILLED.append(f"{module.__name__}.{name}")
        setattr(module, name, value)
        return value
    if "__getattr__" not in module.__dict__:
        module.__getattr__ = __getattr__


class _TorchFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith("torch."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None:
            TORCH_FILLED.append(fullname + " (module)")
            return importlib.machinery.ModuleSpec(fullname, _StubFinder([]), is_package=True)
        orig = spec.loader.exec_module
        def exec_module(module, orig=orig):
            orig(module)
            _fill_getattr(module)
        spec.loader.exec_module = exec_module
        return spec


def _schema_type(annotation) -> str:
    import typing

    import torch

    if annotation is None or annotation is type(None):
        return "()"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _schema_type(inner[0]) + ("?" if len(inner) < len(args) else "")
    if origin in (list, tuple) or annotation in (list, tuple):
        if origin is tuple and args and args[-1] is not Ellipsis:
            return "(" + ", ".join(_schema_type(a) for a in args) + ")"
        return (_schema_type(args[0]) if args else "Tensor") + "[]"
    return {torch.Tensor: "Tensor", int: "SymInt", float: "float", bool: "bool", str: "str",
            torch.dtype: "ScalarType", torch.device: "Device"}.get(annotation, "Any")


def _infer_schema(fn, mutates_args=(), **_):
    """A subset of torch 2's torch.library.infer_schema: the schema string from the
    function's annotations (what vLLM's op registration parses; nothing dispatches)."""
    import inspect
    import typing

    hints = typing.get_type_hints(fn)
    params = []
    for name, p in inspect.signature(fn).parameters.items():
        kind = _schema_type(hints.get(name, p.annotation))
        if mutates_args != "unknown" and name in (mutates_args or ()) and kind.startswith("Tensor"):
            kind = kind.replace("Tensor", f"Tensor(a{len(params)}!)", 1)
        default = "" if p.default is inspect.Parameter.empty else f"={p.default!r}"
        params.append(f"{kind} {name}{default}")
    returns = _schema_type(hints.get("return", None))
    return f"({', '.join(params)}) -> {returns}"


def install(names=()):
    import torch
    import torch.library

    if not hasattr(torch.library, "infer_schema"):
        TORCH_FILLED.append("torch.library.infer_schema")
        torch.library.infer_schema = _infer_schema
    _Library = torch.library.Library

    class Library(_Library):
        """torch 1.13 knows DEF/IMPL only; FRAGMENT libraries become inert."""

        def __init__(self, ns, kind, dispatch_key=""):
            self._inert = kind == "FRAGMENT"
            if not self._inert:
                super().__init__(ns, kind, dispatch_key)
            else:
                self.ns, self.kind, self.dispatch_key = ns, kind, dispatch_key

        def define(self, *a, **k):
            if not self._inert:
                return super().define(*a, **k)

        def impl(self, op_name, fn, *a, **k):
            if not self._inert:
                return super().impl(op_name, fn, *a, **k)
            # The op's Python function stands in for the dispatcher entry.
            namespace = getattr(torch.ops, self.ns)
            base, _, overload = op_name.partition(".")
            if overload:
                setattr(getattr(namespace, base), overload, _PyOp(f"{self.ns}::{op_name}", fn))
            else:
                setattr(namespace, base, _PyOp(f"{self.ns}::{op_name}", fn))

        def _register_fake(self, *a, **k):
            if not self._inert:
                raise NotImplementedError("_register_fake")

        def __del__(self):
            if not getattr(self, "_inert", True):
                super().__del__()

    torch.library.Library = Library
    import torch.distributed.distributed_c10d as c10d

    if not hasattr(c10d, "_get_default_timeout"):
        TORCH_FILLED.append("torch.distributed.distributed_c10d._get_default_timeout")
        c10d._get_default_timeout = lambda backend=None: c10d.default_pg_timeout
    for name in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        if not hasattr(torch.cpu, name):  # CpuPlatform's CPU feature probes (torch 2)
            TORCH_FILLED.append(f"torch.cpu.{name}")
            setattr(torch.cpu, name, lambda: False)
    _init_process_group = torch.distributed.init_process_group
    _new_group = torch.distributed.new_group

    def init_process_group(*args, timeout=None, **kwargs):
        """torch 2 takes timeout=None for the default; torch 1.13 needs a timedelta."""
        return _init_process_group(*args, timeout=timeout or c10d.default_pg_timeout, **kwargs)

    def new_group(*args, timeout=None, device_id=None, **kwargs):
        return _new_group(*args, timeout=timeout or c10d.default_pg_timeout, **kwargs)

    torch.distributed.init_process_group = init_process_group
    torch.distributed.new_group = new_group
    _Tag = torch.Tag

    class _TagMeta(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            TORCH_FILLED.append(f"torch.Tag.{name}")
            return f"torch.Tag.{name}"  # only ever handed to an inert FRAGMENT library

    class Tag(metaclass=_TagMeta):
        pass

    for member in dir(_Tag):
        if not member.startswith("_"):
            setattr(Tag, member, getattr(_Tag, member))
    torch.Tag = Tag
    # torch 2 dtypes: stand-ins nothing here computes with (float64 is never a model
    # dtype in these tests, so a dtype-keyed table cannot confuse the two).
    for n, stand_in in (("float8_e4m3fn", torch.float64), ("float8_e5m2", torch.float64),
                        ("float8_e4m3fnuz", torch.float64), ("float8_e5m2fnuz", torch.float64),
                        ("float8_e8m0fnu", torch.float64), ("float4_e2m1fn_x2", torch.uint8),
                        ("uint16", torch.int16), ("uint32", torch.int32), ("uint64", torch.int64)):
        if not hasattr(torch, n):
            TORCH_FILLED.append(f"torch.{n} (dtype)")
            setattr(torch, n, stand_in)
    for name, mod in list(sys.modules.items()):
        if name == "torch" or name.startswith("torch."):
            if isinstance(mod, types.ModuleType):
                _fill_getattr(mod)
    sys.meta_path.insert(0, _TorchFinder())
    if "msgspec" in names:
        import _msgspec_lite
        _msgspec_lite.install()
        STUBBED_PACKAGES.add("msgspec")
        names = [n for n in names if n != "msgspec"]
    sys.meta_path.append(_StubFinder(names, metadata_only=("vllm",)))
