"""One recipe of each weight format, made fresh per use (recipes and their states are per model).

Shared by the tests that run a case per format; delayed scaling keeps a short history so that a
few steps exercise its update."""

from __future__ import annotations

import minifloat as mf

FORMAT_RECIPES = {
    "current": lambda: mf.Float8CurrentScaling(),
    "delayed": lambda: mf.DelayedScaling(amax_history_len=4),
    "block": lambda: mf.Float8BlockScaling(),
    "mxfp8": lambda: mf.MXFP8BlockScaling(),
    "nvfp4": lambda: mf.NVFP4BlockScaling(disable_stochastic_rounding=True),
}
