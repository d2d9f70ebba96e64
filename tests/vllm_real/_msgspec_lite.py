"""A minimal stand-in for the `msgspec` package (absent here): `Struct` as a plain
keyword/positional record built from the class annotations, `field`, `NODEFAULT`,
`structs.fields/asdict/replace`, and error classes. No (de)serialisation: the
msgpack encoder and decoder raise, because nothing in these tests crosses vLLM's
ZeroMQ engine-client boundary (the processes talk through multiprocessing)."""

from __future__ import annotations

import copy
import sys
import types
import typing


class _NoDefault:
    def __repr__(self):
        return "NODEFAULT"


NODEFAULT = _NoDefault()


class _Field:
    def __init__(self, default=NODEFAULT, default_factory=NODEFAULT, name=None):
        self.default = default
        self.default_factory = default_factory
        self.name = name


def field(*, default=NODEFAULT, default_factory=NODEFAULT, name=None):
    return _Field(default, default_factory, name)


class ValidationError(ValueError):
    pass


class DecodeError(ValueError):
    pass


class EncodeError(ValueError):
    pass


class FieldInfo(typing.NamedTuple):
    name: str
    encode_name: str
    type: typing.Any
    default: typing.Any = NODEFAULT
    default_factory: typing.Any = NODEFAULT

    @property
    def required(self):
        return self.default is NODEFAULT and self.default_factory is NODEFAULT


def _is_classvar(annotation) -> bool:
    text = annotation if isinstance(annotation, str) else repr(annotation)
    return "ClassVar" in text


class Struct:
    __struct_fields__ = ()
    __struct_defaults__ = {}

    def __init_subclass__(cls, **options):
        cls.__struct_options__ = options
        fields: list[str] = []
        defaults: dict[str, typing.Any] = {}
        for klass in reversed(cls.__mro__):
            for name, annotation in klass.__dict__.get("__annotations__", {}).items():
                if _is_classvar(annotation):
                    continue
                if name not in fields:
                    fields.append(name)
                if name in klass.__dict__:
                    value = klass.__dict__[name]
                    if isinstance(value, (property, types.FunctionType, classmethod, staticmethod)):
                        continue
                    defaults[name] = value
                elif klass is cls:
                    defaults.pop(name, None)
            for name, value in getattr(klass, "__struct_defaults__", {}).items():
                defaults.setdefault(name, value)
        cls.__struct_fields__ = tuple(fields)
        cls.__struct_defaults__ = defaults
        for name in fields:  # a default left on the class would shadow nothing, but msgspec removes them
            if name in cls.__dict__ and not isinstance(cls.__dict__[name], (property,)):
                try:
                    delattr(cls, name)
                except AttributeError:
                    pass

    def __init__(self, *args, **kwargs):
        fields = type(self).__struct_fields__
        if len(args) > len(fields):
            raise TypeError(f"{type(self).__name__} takes at most {len(fields)} positional arguments")
        values = dict(zip(fields, args))
        for name, value in kwargs.items():
            if name not in fields:
                raise TypeError(f"{type(self).__name__} got an unexpected keyword argument {name!r}")
            if name in values:
                raise TypeError(f"{type(self).__name__} got multiple values for {name!r}")
            values[name] = value
        defaults = type(self).__struct_defaults__
        for name in fields:
            if name in values:
                value = values[name]
            elif name in defaults:
                value = defaults[name]
                if isinstance(value, _Field):
                    value = value.default_factory() if value.default_factory is not NODEFAULT else value.default
                elif isinstance(value, (list, dict, set)):
                    value = copy.copy(value)
            else:
                raise TypeError(f"{type(self).__name__} missing required argument {name!r}")
            object.__setattr__(self, name, value)
        post_init = getattr(self, "__post_init__", None)
        if post_init is not None:
            post_init()

    def __eq__(self, other):
        if type(other) is not type(self):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in self.__struct_fields__)

    __hash__ = object.__hash__

    def __repr__(self):
        inner = ", ".join(f"{f}={getattr(self, f, None)!r}" for f in self.__struct_fields__)
        return f"{type(self).__name__}({inner})"

    def __copy__(self):
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __rich_repr__(self):
        for f in self.__struct_fields__:
            yield f, getattr(self, f)


def _fields(struct_or_type):
    cls = struct_or_type if isinstance(struct_or_type, type) else type(struct_or_type)
    hints = {}
    for klass in reversed(cls.__mro__):
        hints.update(klass.__dict__.get("__annotations__", {}))
    out = []
    for name in cls.__struct_fields__:
        default = cls.__struct_defaults__.get(name, NODEFAULT)
        factory = NODEFAULT
        if isinstance(default, _Field):
            default, factory = default.default, default.default_factory
        out.append(FieldInfo(name, name, hints.get(name), default, factory))
    return tuple(out)


def _asdict(struct):
    return {f: getattr(struct, f) for f in struct.__struct_fields__}


def _replace(struct, **changes):
    values = _asdict(struct)
    values.update(changes)
    return type(struct)(**values)


def _unsupported(*args, **kwargs):
    raise NotImplementedError("msgspec serialisation is not available in this test environment")


class _Codec:
    def __init__(self, *args, **kwargs):
        pass

    encode = decode = encode_into = staticmethod(_unsupported)


def to_builtins(obj, *args, **kwargs):
    if isinstance(obj, Struct):
        return {k: to_builtins(v) for k, v in _asdict(obj).items()}
    if isinstance(obj, (list, tuple)):
        return [to_builtins(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_builtins(v) for k, v in obj.items()}
    return obj


def convert(obj, type, *args, **kwargs):
    if isinstance(obj, dict) and isinstance(type, builtins_type) and issubclass(type, Struct):
        return type(**obj)
    return obj


builtins_type = type


class Raw(bytes):
    pass


class Meta:
    def __init__(self, *args, **kwargs):
        pass


def install() -> types.ModuleType:
    module = sys.modules[__name__]
    msgspec = types.ModuleType("msgspec")
    for name in ("Struct", "field", "NODEFAULT", "ValidationError", "DecodeError", "EncodeError", "to_builtins",
                 "convert", "Raw", "Meta"):
        setattr(msgspec, name, getattr(module, name))
    msgpack = types.ModuleType("msgspec.msgpack")
    msgpack.Encoder = msgpack.Decoder = _Codec
    msgpack.encode = msgpack.decode = _unsupported
    msgpack.Ext = type("Ext", (), {"__init__": lambda self, code, data: (setattr(self, "code", code), setattr(self, "data", data))[0]})
    structs = types.ModuleType("msgspec.structs")
    structs.fields, structs.asdict, structs.replace = _fields, _asdict, _replace
    structs.FieldInfo = FieldInfo
    msgspec.msgpack, msgspec.structs = msgpack, structs
    msgspec.json = types.ModuleType("msgspec.json")
    msgspec.json.encode = msgspec.json.decode = _unsupported
    msgspec.json.Encoder = msgspec.json.Decoder = _Codec
    msgspec.__version__ = "0.0.0+ecx-test"
    sys.modules.update({"msgspec": msgspec, "msgspec.msgpack": msgpack, "msgspec.structs": structs,
                        "msgspec.json": msgspec.json})
    return msgspec
