"""What a block's code reads besides its arguments, recorded while it runs, so that two calls are shared only when
they would run the same way.

``recording_reads(module)`` records, as ``key -> value key``:

* every plain instance attribute read on the block's submodules (``(path, name)``), and a read of a submodule's
  whole ``__dict__`` by the model's code (``(path, "__dict__")``: its plain entries, by value);
* every global the model's code loads (``("<global>", namespace id, name)``) and every closure variable it reads
  (``("<closure>", code id, name)``): the code run while recording, outside torch, fxpar and the standard
  library (a module-level ``scale`` the model sets before each layer, a helper object shared by every layer).
  A closure variable has no cell to read it from later: it is compared when the block is traced after the
  export (``fxpar.stitch``), not between two calls (a variable rebound between two calls of one block is the
  one change this misses).

A value is keyed by value when it is plain data. A plain dict, list or tuple, and a module the block holds without
registering it that has no parameters, buffers, children or hooks, are keyed by their type and contents; any other
object, module or class by identity and by its contents. Contents are read three levels down (a config's nested
field, a class attribute, a global dict's nested entry: a field changed in place between two calls tells them
apart), up to 256 entries in all; beyond that, and for a function, a Python module, a tensor, a logger or an enum,
a value is keyed by identity alone.
"""

from __future__ import annotations

import dis
import enum
import functools
import logging
import math
import os
import sys
import sysconfig
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from fxpar.not_shared import NotShared

PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device)
_PLAIN_TYPES = frozenset(PLAIN)  # exact types: the common case of a config's fields, keyed without a call
_BY_IDENTITY = (types.ModuleType, torch.Tensor, logging.Logger, enum.Enum, enum.EnumMeta)
MODULE_INTERNALS = frozenset(torch.nn.Module().__dict__) - {"training"}
MISSING = object()
CLOSURE = "<closure>"
GLOBAL = "<global>"
_NAMESPACES: dict[str, dict[str, Any]] = {}  # namespace id -> a module's globals that a block's code loaded
_FXPAR = os.path.dirname(sys.modules["fxpar"].__file__) + os.sep
_NOT_MODEL_CODE = (os.path.dirname(torch.__file__) + os.sep, _FXPAR)
_BUNDLED_MODELS = tuple(_FXPAR + d + os.sep for d in ("models", "testing"))  # user code that fxpar ships
_STDLIB = (sysconfig.get_paths()["stdlib"], "<frozen")
_DEPTH = 3  # levels of containers and objects a value's key reads (below: by identity)
_BUDGET = 256  # entries a value's key reads in all (a larger container or object is keyed by identity)


def plain_key(v: Any) -> tuple[Any, ...]:
    """Equal for values a block's code cannot tell apart: ``1``, ``True`` and ``1.0`` compare equal but are not
    (``x is True``, ``isinstance``), nor are ``0.0`` and ``-0.0`` (``math.copysign``)."""
    if isinstance(v, float):
        return ("float", v, math.copysign(1.0, v))
    return (type(v).__name__, v)


def value_key(v: Any, depth: int = _DEPTH) -> Any:
    """A hashable key equal for two values the block's code would treat alike (see the module docstring)."""
    return _key(v, depth, [_BUDGET])


def _key(v: Any, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if isinstance(v, PLAIN):
        return plain_key(v)
    if isinstance(v, Snapshot):
        return ("snapshot", v.key)
    if isinstance(v, _BY_IDENTITY):  # not asked for attributes (a lazy module's may import; a logger's or an enum's
        return ("id", id(v))  # state does not change what a block computes)
    if isinstance(v, functools.partial):  # e.g. an activation's per-layer partial(gelu, approximate="tanh")
        return ("partial", _key(v.func, depth, budget), tuple(_key(x, depth, budget) for x in v.args),
                tuple(sorted((k, _key(x, depth, budget)) for k, x in v.keywords.items())))
    if hasattr(v, "cast_key"):  # ``fxpar.mixed_precision``'s casting forward: a closure per module, same behaviour
        original = v.original
        return ("cast", _key(getattr(original, "__func__", original), depth, budget), v.cast_key)
    if isinstance(v, (tuple, list, frozenset)) and all(isinstance(x, PLAIN) for x in v):
        return (type(v).__name__, tuple(map(plain_key, v)))
    if isinstance(v, types.MethodType):  # made anew at every access: the function, and whose method it is
        owner = v.__self__
        return ("method", id(v.__func__), "module" if isinstance(owner, torch.nn.Module) else _key(owner, 0, budget))
    if depth > 0 and isinstance(v, types.FunctionType) and v.__closure__:  # a closure made per module or call: its
        return ("closure", id(v.__code__), tuple(_cell_key(c, budget) for c in v.__closure__))  # code, what it holds
    if depth == 0 or isinstance(v, (types.FunctionType, types.BuiltinFunctionType)):
        return ("id", id(v))
    contents = _contents(v)
    if contents is None or len(contents) > max(budget[0], 0):  # too large to read: by identity
        return ("id", id(v))
    read = tuple((k, plain_key(x) if type(x) in _PLAIN_TYPES else _key(x, depth - 1, budget)) for k, x in contents)
    if _whole_in(v, contents):
        return ("contents", id(type(v)), read)
    return ("id", id(v), read)


def _whole_in(v: Any, contents: list[tuple[Any, Any]]) -> bool:
    """Whether ``contents`` is all a value holds, so that its class and contents decide what code reading it does:
    a plain dict, list or tuple whose keys were all read (torch.export rebuilds these when it puts a module's
    attributes back after the trace: the same contents, a new object; a subclass may hold more, such as a
    ``defaultdict``'s factory, and stays keyed by identity), or a module without parameters, buffers, children or
    hooks (a per-layer helper such as transformers' hub-kernel wrappers, one per layer)."""
    if type(v) in (dict, list, tuple):
        return len(contents) == len(v)
    if isinstance(v, torch.nn.Module):
        return not any(x for k, x in v.__dict__.items() if k in MODULE_INTERNALS and isinstance(x, (dict, set)))
    return False


def _cell_key(cell: Any, budget: list[int]) -> Any:
    try:
        return _key(cell.cell_contents, 0, budget)
    except ValueError:  # an empty cell
        return "empty"


def _contents(v: Any) -> list[tuple[Any, Any]] | None:
    """A container's items, an object's fields, a module's own fields (not its parameters, buffers or children,
    known by identity) or a class's data attributes, one level down (None: nothing to read)."""
    if isinstance(v, dict):
        return [(k, x) for k, x in v.items() if isinstance(k, PLAIN)]
    if isinstance(v, (list, tuple)):
        return list(enumerate(v))
    if isinstance(v, type):
        return [(k, x) for k, x in vars(v).items() if not k.startswith("__") and not callable(x)
                and not isinstance(x, (staticmethod, classmethod, property))]
    fields = getattr(v, "__dict__", None)
    if not isinstance(fields, dict):
        return None
    if isinstance(v, torch.nn.Module):
        return [(k, x) for k, x in fields.items() if k not in MODULE_INTERNALS and k != "_fxpar_reads"]
    return list(fields.items())


class Snapshot:
    """The plain entries of a submodule's ``__dict__`` (the model's code read the whole of it)."""

    def __init__(self, fields: dict[str, Any]) -> None:
        self.key = tuple(sorted((k, plain_key(x)) for k, x in fields.items()
                                if k not in MODULE_INTERNALS and k != "_fxpar_reads" and isinstance(x, PLAIN)))


def reads_hold(module: torch.nn.Module, reads: dict[tuple[str, ...], Any]) -> bool:
    """Whether every read in ``reads`` (closure variables aside: see the module docstring) holds the value key it
    recorded, for ``module`` now (each submodule looked up once: a layer's code reads dozens of its fields)."""
    fields: dict[str, dict[str, Any]] = {}
    for read, want in reads.items():
        if read[0] == CLOSURE:
            continue
        if read[0] == GLOBAL:
            now = _NAMESPACES[read[1]].get(read[-1], MISSING)
        else:
            where, name = read[-2], read[-1]
            held = fields.get(where)
            if held is None:
                held = fields[where] = module.get_submodule(where).__dict__
            now = Snapshot(held) if name == "__dict__" else held.get(name, MISSING)
        if value_key(now) != want:
            return False
    return True


def check_reads_unchanged(path: str, then: dict[tuple[str, ...], Any], now: dict[tuple[str, ...], Any]) -> None:
    """Raise ``NotShared`` unless every read recorded at a call (``then``) holds the same value when the block is
    traced after the whole export (``now``): a global the model sets before each layer, a helper's field."""
    for read, value in then.items():
        if now.get(read, value) != value:
            raise NotShared(f"{path} reads {read[-1]!r}, which changed after its call")


@contextmanager
def recording_reads(module: torch.nn.Module) -> Iterator[dict[tuple[str, ...], Any]]:
    """Inside: record what the code run reads (module docstring) into the yielded ``{read: value key}``."""
    reads: dict[tuple[str, ...], Any] = {}
    swapped = [(m, type(m)) for m in module.modules()]
    paths = {id(m): rel for rel, m in module.named_modules()}
    previous = sys.gettrace()
    try:
        for m, cls in swapped:
            m.__dict__["_fxpar_reads"] = (paths[id(m)], reads)
            m.__class__ = _recording_class(cls)
        sys.settrace(functools.partial(_record_globals, reads))
        yield reads
    finally:
        sys.settrace(previous)
        for m, cls in swapped:
            m.__class__ = cls
            m.__dict__.pop("_fxpar_reads", None)


@contextmanager
def no_attribute_writes(model: torch.nn.Module) -> Iterator[None]:
    """Inside: export ``model`` with its repeated blocks opaque. After: ``NotShared`` if the model's code set a plain
    attribute of any of its modules meanwhile (``self.gate.scale = i + 1`` before each layer, or once before the
    loop): each block is traced once after the export, when torch.export has put the attribute back, so a value the
    model set there would not reach it. Writes through torch.export's module proxies count (they share the
    module's ``__dict__``); tensors and submodules are the export's to track."""
    watched = {id(m.__dict__): path for path, m in model.named_modules()}
    written: list[str] = []
    setattr_ = torch.nn.Module.__setattr__

    def recording_setattr(self: torch.nn.Module, name: str, value: Any) -> None:
        path = watched.get(id(object.__getattribute__(self, "__dict__")))
        if path is not None and not isinstance(value, (torch.Tensor, torch.nn.Module)) and name != "forward" \
                and not name.startswith(("__", "_fxpar")):  # (fxpar's own: opaque calls, recording classes)
            written.append(f"{path}.{name}" if path else name)
        setattr_(self, name, value)

    torch.nn.Module.__setattr__ = recording_setattr  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.__setattr__ = setattr_  # type: ignore[method-assign]
    if written:
        raise NotShared(f"the model's forward sets {written[0]}")


def _record_globals(reads: dict[tuple[str, ...], Any], frame: Any, event: str, arg: Any) -> None:
    """A ``sys.settrace`` hook: record the globals and closure variables a model-code frame loads (no line tracing:
    returns None)."""
    if event != "call":
        return None
    code = frame.f_code
    names = _loaded_names(code)
    if names is None:
        return None
    namespace = frame.f_globals
    token = str(id(namespace))
    for name in names[0]:
        if name in namespace:
            _NAMESPACES.setdefault(token, namespace)
            if (GLOBAL, token, name) not in reads:  # (the first read's value: a key is computed once)
                reads[(GLOBAL, token, name)] = value_key(namespace[name])
    if names[1]:
        local = frame.f_locals
        for name in names[1]:
            if name in local:
                if (CLOSURE, str(id(code)), name) not in reads:
                    reads[(CLOSURE, str(id(code)), name)] = value_key(local[name])
    return None


def _loaded_names(code: types.CodeType) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """The globals a code object loads and its closure variables; None for code that is not the model's (torch's,
    nn.Module's own, fxpar's, the standard library's). Cached by file and code: two code objects compare equal
    when only their files differ."""
    return _names_in(code.co_filename, code)


@functools.cache
def _names_in(path: str, code: types.CodeType) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    if (path.startswith(_NOT_MODEL_CODE) and not path.startswith(_BUNDLED_MODELS)) or _in_stdlib(path):
        return None
    loaded = {i.argval for i in dis.get_instructions(code) if i.opname == "LOAD_GLOBAL"}
    return tuple(sorted(loaded)), code.co_freevars


def _in_stdlib(path: str) -> bool:
    """Whether ``path`` is the standard library's: under its folder but not in a ``site-packages`` there (a plain or
    conda Python installs packages, a model's among them, inside the standard library's folder)."""
    return path.startswith(_STDLIB) and f"{os.sep}site-packages{os.sep}" not in path \
        and f"{os.sep}dist-packages{os.sep}" not in path


_RECORDING: dict[type, type] = {}


def _recording_class(cls: type) -> type:
    if cls not in _RECORDING:
        def __getattribute__(self: Any, name: str) -> Any:  # noqa: N807
            d = object.__getattribute__(self, "__dict__")
            if name == "__dict__":
                if "_fxpar_reads" in d and _loaded_names(sys._getframe(1).f_code) is not None:  # the model's code
                    where, reads = d["_fxpar_reads"]
                    if (where, name) not in reads:
                        reads[(where, name)] = value_key(Snapshot(d))
            elif name not in MODULE_INTERNALS and name != "_fxpar_reads" and not name.startswith("__") \
                    and "_fxpar_reads" in d:  # (a torch.export proxy made while recording inherits the class)
                where, reads = d["_fxpar_reads"]
                if (where, name) in reads:
                    pass
                elif name in d:
                    reads[(where, name)] = value_key(d[name])
                elif not (name in d["_parameters"] or name in d["_buffers"] or name in d["_modules"]):
                    # read from the class, or missing (``getattr(self, name, default)``): a layer whose own
                    # attribute overrides it runs the code another way
                    reads[(where, name)] = value_key(MISSING)
            return object.__getattribute__(self, name)

        own = {"__getattribute__": __getattribute__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
        recording = type(cls.__name__, (cls,), own)
        for name in set(vars(recording)) - {*own, "__doc__"}:  # what the class's ``__init_subclass__`` added (HF's
            delattr(recording, name)  # layers wrap ``forward`` again): the subclass only records
        _RECORDING[cls] = recording
    return _RECORDING[cls]
