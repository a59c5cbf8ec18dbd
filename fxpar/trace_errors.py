"""Why a model could not be traced, in the user's terms: the error's first line, the line of their code it failed
at (or the library module it failed in) and, for values read from tensors, what to do instead."""

from __future__ import annotations

import os
import re
import traceback

import torch
import torch.fx as fx

TORCH_DIR = os.path.dirname(torch.__file__)
FXPAR_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# fxpar's own compiler code; bundled models and test helpers are user code for error reports
COMPILER_DIRS = tuple(os.path.join(FXPAR_ROOT, d) + os.sep for d in ("passes", "backends", "schedules"))
COMPILER_FILES = tuple(os.path.join(FXPAR_ROOT, "fxpar", f) for f in os.listdir(os.path.join(FXPAR_ROOT, "fxpar"))
                        if f.endswith(".py"))


def explain_trace_failure(model: torch.nn.Module, e: BaseException, exported: fx.Graph | None = None) -> str:
    """The error's first line, the user's line it failed at and, for control flow on tensor values, a hint.
    ``exported``: the exported forward, when the failure came after it (tracing the joint): the line is read off
    the node of the op that failed (``.item()``, ``nonzero``), whose frames are no longer on the stack."""
    frame = _user_frame(e)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    where = f"{frame.filename}:{frame.lineno}: {frame.line}" if frame else _line_of_failed_op(exported, str(e))
    module = _failing_module(model, e)
    inside = f"\n  in module {module}" if module else ""
    hint = ""
    if any(w in str(e).lower() or w in type(e).__name__.lower() for w in ("data-dependent", "data dependent",
                                                                          "datadependent", "dynamicoutputshape")):
        hint = (
            "\nhint: Python control flow that depends on tensor values cannot be compiled; "
            "use torch.where / torch.cond, or make the branch depend on shapes only"
        )
    return f"cannot trace {type(model).__name__}: {type(e).__name__}: {first}{inside}\n  at {where}{hint}"


def _line_of_failed_op(graph: fx.Graph | None, message: str) -> str:
    """``file:line: code`` of the user's frame that made the first node of ``graph`` whose op the error names."""
    ops = set(re.findall(r"aten\.(\w+)", message))
    if "_local_scalar_dense" in ops:
        ops.add("item")  # .item() in the exported forward becomes _local_scalar_dense when traced
    for n in graph.nodes if graph is not None and ops else ():
        name = getattr(n.target, "__name__", str(n.target)).split(".")[0]
        frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.*)', n.meta.get("stack_trace") or "")
        user = [f for f in frames if is_user_file(f[0])]
        if n.op == "call_function" and name in ops and user:
            return "{}:{}: {}".format(*user[-1])
    return "(no user frame found)"


def _failing_module(model: torch.nn.Module, e: BaseException) -> str | None:
    """The innermost submodule of ``model`` whose call the failure happened in, as ``path (Class)``: where a
    library module (``nn.Linear`` inside an ``nn.Sequential``) fails, no frame of the user's file is on the stack,
    and the module path is what points at their code."""
    paths = {id(m): name for name, m in model.named_modules()}
    innermost = None
    tb = e.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name in ("_call_impl", "_wrapped_call_impl"):
            module = frame.f_locals.get("self")
            if isinstance(module, torch.nn.Module) and id(module) in paths and module is not model:
                innermost = module
        tb = tb.tb_next
    if innermost is None:
        return None
    return f"{paths[id(innermost)]} ({type(innermost).__name__})"


def _user_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost traceback frame outside torch itself: the user's line; failing that, the innermost one in
    an installed library other than torch (a Hugging Face model's own code lives in site-packages)."""
    best = library = None
    while e is not None:
        for fr in traceback.extract_tb(e.__traceback__):
            if is_user_file(fr.filename):
                best = fr
            elif "site-packages" in fr.filename and not os.path.abspath(fr.filename).startswith(TORCH_DIR):
                library = fr
        e = e.__cause__ or e.__context__
    return best or library


def is_user_file(path: str) -> bool:
    path = os.path.abspath(path) if "<" not in path else path
    return not (path.startswith(TORCH_DIR) or "<" in path or path.startswith(COMPILER_DIRS)
                or path in COMPILER_FILES or "site-packages" in path)
