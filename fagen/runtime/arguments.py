"""The launch argument struct: fagen::AttentionArgs (templates/attention_common.cuh) as a flat list of 8-byte
values, packed once per launch; tests/test_runtime.py checks the two sides against each other."""
from __future__ import annotations

import struct
from typing import Optional

from fagen import cuda_driver as driver

_POINTERS = ("q", "k", "v", "o", "lse", "d_o", "dq", "dk", "dv", "dq_accum", "delta", "o_accum", "row_max", "row_sum")
_FIELDS = ([(name, "Q", 1) for name in _POINTERS]
           + [(f"{t}_stride", "q", 3) for t in ("q", "k", "v", "o", "do", "dq", "dk", "dv")]
           + [(name, "q", 1) for name in ("batch", "heads", "seq_q", "seq_k")]
           + [("kv_lengths", "Q", 1), ("block_mask", "Q", 1), ("block_mask_stride", "q", 4),
              ("seed", "Q", 1), ("offset", "Q", 1), ("row_groups", "q", 1),
              ("kv_group", "q", 1), ("dk_sum", "Q", 1), ("dv_sum", "Q", 1), ("dk_sum_stride", "q", 3),
              ("dv_sum_stride", "q", 3), ("cu_seqlens_q", "Q", 1), ("cu_seqlens_k", "Q", 1),
              ("max_seq_q", "q", 1), ("max_seq_k", "q", 1),
              ("mod_tensor", "Q", 4), ("mod_size", "q", 8), ("mod_stride", "q", 8), ("mod_scalar", "d", 4),
              ("mod_summary", "Q", 4), ("problems", "q", 1), ("seed_pointer", "Q", 1),
              ("block_table", "Q", 1), ("block_table_stride", "q", 1), ("page_size", "q", 1), ("page_count", "q", 1),
              ("mod_grad", "Q", 4), ("fold_heads", "q", 1), ("d_lse", "Q", 1),
              ("descale", "Q", 3), ("descale_stride", "q", 6)])
ARGS_STRUCT = struct.Struct("<" + "".join(code * count for _, code, count in _FIELDS))
_SLOT: dict[str, tuple[int, int]] = {}
for _name, _code, _count in _FIELDS:
    _SLOT[_name] = (sum(c for _, _, c in _FIELDS[:[f[0] for f in _FIELDS].index(_name)]), _count)
for _n in range(4):   # one slot per mod_tensor / mod_summary entry, for the fast path's pointer refills
    _SLOT[f"mod_tensor{_n}"] = (_SLOT["mod_tensor"][0] + _n, 1)
    _SLOT[f"mod_summary{_n}"] = (_SLOT["mod_summary"][0] + _n, 1)
for _n in range(3):   # q's, k's and v's descale factors (an fp8 forward)
    _SLOT[f"descale{_n}"] = (_SLOT["descale"][0] + _n, 1)
_FLOAT_SLOTS = frozenset(range(_SLOT["mod_scalar"][0], _SLOT["mod_scalar"][0] + 4))


class LaunchArgs:
    """AttentionArgs as a flat list of 8-byte values, packed once per launch."""

    __slots__ = ("values",)

    def __init__(self):
        self.values = [0] * (ARGS_STRUCT.size // 8)

    def __setitem__(self, name: str, value) -> None:
        start, count = _SLOT[name]
        convert = float if start in _FLOAT_SLOTS else int
        if count == 1:
            self.values[start] = convert(value)
        else:
            self.values[start:start + count] = [convert(x) for x in value]

    def packed(self, tensor_maps: Optional[int] = None) -> "driver.LaunchArguments":
        """The struct in a launch's parameters; `tensor_maps`: the host address of the kernel's TensorMaps
        parameter, where it takes one (fagen/runtime/tensor_maps.py)."""
        arguments = driver.LaunchArguments(ARGS_STRUCT.size, tensor_maps)
        ARGS_STRUCT.pack_into(arguments.buffer, 0, *self.values)
        return arguments

