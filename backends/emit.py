"""Emit rank programs as standalone Python files plus a manifest."""

from __future__ import annotations

import json
import os

from fxpar.compiled import Compiled
from fxpar.printer import group_vars, print_rank_programs
from fxpar.rank_step import rank_step, step_ledger

PRELUDE = '''import torch

import fxpar.ops
from fxpar.backends import comm

aten = torch.ops.aten
fxpar = torch.ops.fxpar  # fxpar's own ops (fxpar.ops), e.g. fxpar.bmm4
constants: dict = {{}}  # lifted tensor constants, if the program uses any
{groups}
'''


def save_programs(c: Compiled, folder: str, ranks: list[int] | None = None) -> list[str]:
    """Write ``rank<r>.py`` for each rank (all by default) and ``manifest.json``; return the paths.

    Each file defines ``forward`` and ``backward`` for its rank; collectives name groups through
    module-level variables (``TP = "tp[2,3]"``) that ``comm.register_group`` binds at run time.
    """
    os.makedirs(folder, exist_ok=True)
    prog = c.stages[0]
    ranks = list(range(prog.mesh.size)) if ranks is None else ranks
    paths, manifest = [], {"mesh": prog.mesh.axes, "passes": list(prog.passes), "ranks": {}}
    for r in ranks:
        rp = c.rank_program(r)
        all_groups: dict[str, str] = {}
        for stage in c.stage_of_rank(r):
            all_groups.update(group_vars(c.rank_program(r, stage)))
        groups = "\n".join(f"{v} = {s!r}" for s, v in sorted(all_groups.items(), key=lambda kv: kv[1]))
        text = PRELUDE.format(groups=groups) + "\n\n" + print_rank_programs(c, r)
        path = os.path.join(folder, f"rank{r}.py")
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
        manifest["ranks"][str(r)] = {"file": os.path.basename(path), "coord": list(rp.coord),
                                     "groups": {s: list(g) for s, g in rp.groups.items()},
                                     "stages": c.stage_of_rank(r),
                                     "collectives": len(step_ledger(rank_step(c, r)))}
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
    return paths
