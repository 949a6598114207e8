"""The run-time inputs of one call, handed down Kernel's private call chain as one object."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Optional

if TYPE_CHECKING:
    from fagen.runtime.layouts import Sequences


class CallInputs(NamedTuple):
    """What a call passes besides its tensors, outputs and stream. A NamedTuple: one is built per call, on the
    fast path too, whose host time is counted in microseconds.

    - `kv_lengths`: mask padding's valid keys per batch entry;
    - `block_mask`: mask block_sparse's blocks that run;
    - `inputs`: the mask_mod / score_mod run-time inputs, name -> tensor or number;
    - `seed`, `offset`: dropout's (the seed an int or a CUDA tensor holding one int64);
    - `sequences`: a packed batch's `Sequences` (layouts.py), set by the packed paths;
    - `paged`: (the block-table fields of the argument struct, the table) for a paged K/V cache, set by the
      paged paths;
    - `descales`: an fp8 forward's (q_descale, k_descale, v_descale), each a number, a tensor or None."""

    kv_lengths: Any = None
    block_mask: Any = None
    inputs: Optional[dict] = None
    seed: Any = 0
    offset: int = 0
    sequences: Optional[Sequences] = None
    paged: Optional[tuple] = None
    descales: Optional[tuple] = None
