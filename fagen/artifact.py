"""What the build makes and the runtime loads: one kernel's artifact.

fagen/build.py writes it (solve, render, compile, under the disk plan cache), fagen/runtime/'s `Kernel` loads
it and launches; this module is the contract between the two, so that neither imports the other.
"""
from __future__ import annotations

from dataclasses import dataclass

#: 3: the backward WITH_INPUT_GRADS is part of the artifact wherever score_mod has float tensor inputs.
RECORD_FORMAT = 3
#: The keys every record has.
RECORD_KEYS = ("format", "spec", "policy", "plans", "kernels", "cubin_keys", "folds_heads")
#: The cubins' name for the backward built WITH_INPUT_GRADS (fagen/render.py render_input_grad_backward): the
#: backward's symbols, which also add the gradients of score_mod's float tensor inputs.
INPUT_GRAD_BACKWARD = "backward_input_grads"


@dataclass
class Artifact:
    """record: plain JSON (the spec, the plan policy, each pass's plan as the solver's Plan.to_dict, its kernel
    symbols, main kernel first, the cubins' cache keys, and whether each pass's kernel walks a K/V head's group of
    query heads: fagen/sources.py folds_kv_group); cubins: bytes by pass, plus INPUT_GRAD_BACKWARD where the spec
    has one."""

    record: dict
    cubins: dict[str, bytes]
