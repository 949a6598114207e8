"""Stage 1: the attention spec.

A `Spec` is the algorithm written once (Halide's split: the schedule, Br/Bc, is the solver's job).
It is frozen, validated by pydantic, loadable from YAML (one spec or a list of variants), and has a
canonical name that is a pure function of every field.
"""
from __future__ import annotations

import difflib
import functools
import hashlib
import json
import math
import re
import reprlib
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, ValidationInfo, field_validator,
                      model_validator)

from fagen.target import arch_features

DTYPES = ("fp16", "bf16", "fp32", "fp8_e4m3")
DTYPES_EVERY_PASS = ("fp16", "bf16", "fp32")   # the dtypes every pass, arch and loop order takes (fp8_e4m3: _check_fp8)
MASKS = ("none", "causal", "sliding_window", "padding", "block_sparse")
LOOP_ORDERS = ("fa1", "fa2")
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
PASSES = ("forward", "backward")          # the default: what a spec builds unless `passes` says otherwise
ALL_PASSES = PASSES + ("decode",)         # decode: the split-KV forward for few query rows (opt-in)
DECODE_MASKS = ("none", "causal", "sliding_window", "padding")
TILE_POLICIES = ("paper", "auto")
LAYOUTS = ("padded", "packed")
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8_e4m3": 1}
#: the dtype of o where it differs from q's: an fp8 forward writes bf16 (FlashAttention-3's interface)
OUTPUT_DTYPES = {"fp8_e4m3": "bf16"}
FP8_PASSES = ("forward",)                 # the passes an fp8_e4m3 spec builds (its backward is not built yet)
LATENT_PASSES = ("decode",)               # a latent_kv spec's: the decode kernel takes any number of query rows
LATENT_MAX_HEAD_DIM = 576                 # latent_kv's widest k (MLA: 512 latent + 64 rope columns)
LATENT_MAX_VALUE_DIM = 512
INT32_MAX = 2**31 - 1                     # the kernels hold positions, lengths and windows in int
FLT_MAX = 3.4028234663852886e38           # the largest float32: a scale beyond it is inf on the GPU
FLT_MIN = 1.1754943508222875e-38          # the smallest normal float32
MAX_NAME_CHARS = 81                       # a variant name is a C identifier of at most this many characters
MIN_DROPOUT = 2.0**-16   # the kernels keep an element iff its 16-bit draw >= floor(p * 2**16): a smaller p drops nothing

_SIZE_UNITS = {"": 1, "b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?i?[bB]?)\s*$")


class SpecError(ValueError):
    """A spec that cannot be built; the message is one line naming file, field, value and what is allowed.
    `detail` is the message without the place (`where`) it is prefixed with."""

    def __init__(self, detail: str, where: Optional[str] = None):
        self.detail = detail
        super().__init__(f"{where}: {detail}" if where else detail)


def parse_bytes(value: Union[int, str]) -> int:
    """`49152`, `"48KiB"`, `"48 KB"` -> bytes."""
    if isinstance(value, bool):
        raise ValueError("must be a number of bytes or a size such as '48KiB'")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _SIZE_RE.match(str(value)) if len(str(value)) <= 32 else None
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{_short(value)} is not a size: write bytes (49152) or a size such as '48KiB' or '96KB'")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[unit.lower()])


class Spec(BaseModel):
    """One attention variant. Field docs become the JSON Schema's descriptions (`fagen schema`)."""

    # (the schema's head dims: up to 576 / 512 only with latent_kv, as the validators say)
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, json_schema_extra={
        "if": {"properties": {"latent_kv": {"const": True}}, "required": ["latent_kv"]},
        "else": {"properties": {"head_dim": {"maximum": 256}, "value_head_dim": {"maximum": 256}}}})

    def __init__(self, **data: Any) -> None:
        """Spec(head_dim=64, ...): a bad field raises SpecError, one line, as a spec file's does."""
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise SpecError(_validation_message(err, data), where="Spec") from None

    name: Optional[str] = Field(None, strict=True, description="Variant name; default derived from every other field.")
    head_dim: int = Field(..., strict=True, description="Head dimension d: any from 1 to 256 (up to 576 with "
                          "latent_kv).", json_schema_extra={"minimum": 1, "maximum": LATENT_MAX_HEAD_DIM})
    value_head_dim: Optional[int] = Field(
        None, strict=True, description="Head dimension of v and o when it differs from q's and k's (DeepSeek's MLA: "
        "head_dim 192, value_head_dim 128); default head_dim. Both multiples of 8, fp16 or bf16, loop_order fa2, not "
        "deterministic. At most 256 (512 with latent_kv).",
        json_schema_extra={"minimum": 8, "maximum": LATENT_MAX_VALUE_DIM})
    latent_kv: bool = Field(
        False, strict=True, description="Keys and values are one latent cache (DeepSeek's MLA decoding: head_dim 576, "
        "value_head_dim 512): k holds head_dim columns, the latent then the rope part, and v is k's first "
        "value_head_dim columns, so calls pass no v. Decoding only (passes [decode]): any number of query rows, fp16 "
        "or bf16, masks none, causal, sliding_window or padding, padded or paged caches.")
    dtype: Literal["fp16", "bf16", "fp32", "fp8_e4m3"] = Field(
        "fp16", description="Element type of q, k, v and o. fp8_e4m3: q, k, v in e4m3 with run-time descale factors "
        "(q_descale, k_descale, v_descale), o in bf16; the forward only, on sm_90, head dims 64, 128, 192 or 256.")
    mask: Literal["none", "causal", "sliding_window", "padding", "block_sparse"] = Field(
        "none", description="Which (query, key) pairs are visible.")
    window: Optional[int] = Field(
        None, strict=True, description="sliding_window only: each query sees itself and the window-1 keys before it.",
        json_schema_extra={"minimum": 1, "maximum": INT32_MAX})
    block_size: Optional[int] = Field(
        None, strict=True, description="block_sparse only: granularity of the run-time block layout (16..256, power "
        "of 2).", json_schema_extra={"enum": [16, 32, 64, 128, 256]})
    dropout: float = Field(0.0, strict=True, description="Dropout probability on the attention weights: 0, or in "
                           "[2**-16, 1) (applied as floor(p * 65536) / 65536).",
                           json_schema_extra={"minimum": 0, "exclusiveMaximum": 1})
    softmax_scale: Optional[float] = Field(None, strict=True, description="Scale tau applied to Q.K^T; default "
                                           "1/sqrt(head_dim).",
                                           json_schema_extra={"exclusiveMinimum": 0, "maximum": FLT_MAX})
    loop_order: Literal["fa1", "fa2"] = Field(
        "fa2", description="fa1: K/V blocks outer, O/l/m in HBM (FlashAttention-1). fa2: Q blocks outer.")
    sram_budget: Optional[Union[int, str]] = Field(
        None, description="Shared memory per block in bytes or as '48KiB'; default: the target's per-block limit.")
    tile_policy: Literal["paper", "auto"] = Field(
        "auto", description="paper: the FlashAttention-1 closed form; auto: the template's own footprint.")
    arch: Literal["sm_80", "sm_86", "sm_89", "sm_90"] = Field("sm_90", description="GPU architecture to build for.")
    passes: tuple[Literal["forward", "backward", "decode"], ...] = Field(
        ("forward", "backward"), description="Which kernels to generate: forward, backward, and decode (the "
        "split-KV forward that calls with few query rows, group x Nq <= 16, take instead of forward). Default: forward "
        "and backward (forward alone for dtype fp8_e4m3, decode alone for latent_kv).")
    deterministic: bool = Field(False, strict=True, description="Backward without atomics: bitwise-reproducible dq.")
    mask_mod: Optional[str] = Field(
        None, description="A boolean expression over b, h, i, j (sequence, query head, query and key position; "
        "positions count from 0 in each of q and k, not shifted when Nq != Nk), Nq, Nk and the declared inputs, "
        "ANDed with `mask`. Example: 'doc[b, i] == doc[b, j]'.")
    score_mod: Optional[str] = Field(
        None, description="An expression of `score` (tau * q.k) and the names mask_mod may use: the score the "
        "softmax sees. Its derivative in score (sympy's) drives the backward. Example: 'cap * tanh(score / cap)'.")
    inputs: Annotated[Optional[tuple[tuple[str, Literal["scalar", "float32", "int32"]], ...]],
                      WithJsonSchema({"anyOf": [{"type": "object", "additionalProperties": {
                          "enum": ["scalar", "float32", "int32"]}}, {"type": "null"}]})] = Field(
        None, description="Run-time inputs of mask_mod / score_mod, name -> kind: scalar (a number), float32 or "
        "int32 (a tensor of 1 or 2 dimensions, indexed in the expression as name[...]; indices are clamped "
        "into the tensor).")
    layout: Literal["padded", "packed"] = Field(
        "padded", description="padded: q (batch, heads, Nq, d), every batch entry Nq queries and Nk keys. packed: "
        "sequences of different lengths back to back, q (total_q, heads, d), k and v (total_k, kv_heads, d), "
        "located by cu_seqlens_q / cu_seqlens_k at run time (FlashAttention-2's varlen convention).")

    @field_validator("head_dim")
    @classmethod
    def _head_dim(cls, value: int) -> int:
        if isinstance(value, bool) or not (1 <= value <= LATENT_MAX_HEAD_DIM):
            raise ValueError(f"{_short(value)} is not allowed: head_dim must be from 1 to 256 (up to "
                             f"{LATENT_MAX_HEAD_DIM} with latent_kv)")
        return value

    @field_validator("value_head_dim")
    @classmethod
    def _value_head_dim(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        if value is None:
            return None
        if isinstance(value, bool) or not (1 <= value <= LATENT_MAX_VALUE_DIM):
            raise ValueError(f"{_short(value)} is not allowed: value_head_dim must be from 8 to 256 (a multiple of 8; "
                             f"up to {LATENT_MAX_VALUE_DIM} with latent_kv)")
        return None if value == info.data.get("head_dim") else value   # the same d: the same spec as without it

    @field_validator("dropout")
    @classmethod
    def _dropout(cls, value: float) -> float:
        if not (0.0 <= value < 1.0):
            raise ValueError(f"{value} is not allowed: dropout is a probability in [0, 1)")
        if 0.0 < value < MIN_DROPOUT:
            raise ValueError(f"{value} is not allowed: a non-zero dropout must be at least 2**-16 "
                             f"(~1.5e-5), the resolution of the 16-bit random draws; use 0 for none")
        return float(value)

    @field_validator("softmax_scale")
    @classmethod
    def _scale(cls, value: Optional[float]) -> Optional[float]:
        if value is not None and not (math.isfinite(value) and FLT_MIN <= value <= FLT_MAX):
            raise ValueError(f"{value} is not allowed: softmax_scale must be a positive number that float32 holds "
                             f"({FLT_MIN:.4g} to {FLT_MAX:.4g})")
        return value

    @field_validator("window")
    @classmethod
    def _window(cls, value: Optional[int]) -> Optional[int]:
        if value is not None and not (1 <= value <= INT32_MAX):
            raise ValueError(f"{_short(value)} is not allowed: window is a positive number of keys, at most 2**31 - 1 "
                             "(the kernels' int32)")
        return value

    @field_validator("sram_budget", mode="before")
    @classmethod
    def _budget(cls, value: Union[int, str, None]) -> Optional[int]:
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a size: write bytes (49152) or a size such as '48KiB'")
        if value is None:
            return None
        nbytes = parse_bytes(value)
        if not (0 < nbytes <= INT32_MAX):
            raise ValueError(f"{_short(value)} is not allowed: sram_budget is from 1 byte to 2 GiB")
        return nbytes

    @field_validator("passes", mode="before")
    @classmethod
    def _passes(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError("at least one of forward, backward, decode is needed")
            if not all(isinstance(name, str) for name in value):
                return value   # pydantic's own message names the allowed passes
            if len(set(value)) != len(value):
                raise ValueError(f"{list(value)} names a pass twice")
            return tuple(sorted(value, key=lambda p: ALL_PASSES.index(p) if p in ALL_PASSES else 99))
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: Optional[str]) -> Optional[str]:
        if value is None:
            return value
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise ValueError(f"{_short(value)} is not allowed: a name is a C identifier (ASCII letters, digits, _, "
                             "not starting with a digit)")
        if len(value) > MAX_NAME_CHARS:
            raise ValueError(f"a name of {len(value)} characters is too long: at most {MAX_NAME_CHARS}")
        return value

    @model_validator(mode="before")
    @classmethod
    def _expressions_from_python(cls, data: Any) -> Any:
        """mask_mod / score_mod given from the API as sympy expressions or Python callables (traced with
        fagen.expressions.Traced values, FlexAttention's parameter names accepted) become their text,
        so that a spec is always data: YAML, JSON and the canonical name see the same thing."""
        if not isinstance(data, dict):
            return data
        for field in ("mask_mod", "score_mod"):
            value = data.get(field)
            if value is not None and not isinstance(value, str):
                from fagen.expressions import ExpressionError, as_text
                try:
                    inputs = dict(data.get("inputs") or {})
                except (TypeError, ValueError):
                    inputs = None   # not a mapping: the inputs' own validator says so
                try:
                    data = {**data, field: as_text(value, field, inputs)}
                except (ExpressionError, TypeError) as err:
                    raise ValueError(str(err)) from None
        return data

    @model_validator(mode="before")
    @classmethod
    def _default_passes(cls, data: Any) -> Any:
        """A spec that names no passes builds its kind's: an fp8_e4m3 spec the forward alone (its backward is not
        built yet), a latent_kv spec the decode pass alone."""
        if isinstance(data, dict) and "passes" not in data:
            if data.get("latent_kv") is True:
                return {**data, "passes": list(LATENT_PASSES)}
            if data.get("dtype") == "fp8_e4m3":
                return {**data, "passes": list(FP8_PASSES)}
        return data

    @field_validator("mask_mod", "score_mod", mode="before")
    @classmethod
    def _expression_text(cls, value: Any) -> Any:
        if isinstance(value, str) and not value.strip():
            raise ValueError("is empty: write an expression or leave the field out")
        return value

    @field_validator("inputs", mode="before")
    @classmethod
    def _inputs(cls, value: Any) -> Any:
        # A mapping (YAML, Python) or pairs -> pairs sorted by name: hashable, and the order of the kernel's
        # input slots cannot depend on how the spec was written (canonical_json sorts the mapping's keys,
        # so two declarations in different orders must mean the same slots)
        if isinstance(value, dict):
            value = tuple(value.items())
        if isinstance(value, (list, tuple)):
            if not value:
                return None
            if not all(isinstance(pair, (list, tuple)) and len(pair) == 2 for pair in value):
                raise ValueError("must be a mapping of input names to kinds, e.g. {doc: int32, cap: scalar}")
            return tuple(sorted((tuple(pair) for pair in value), key=lambda pair: str(pair[0])))
        return value

    @model_validator(mode="after")
    def _mask_parameters(self) -> "Spec":
        if self.mask == "sliding_window":
            if self.window is None or self.window < 1:
                raise ValueError("mask sliding_window needs `window`, a positive number of keys")
        elif self.window is not None:
            raise ValueError(f"window is only for mask sliding_window, not {self.mask}")
        if self.mask == "block_sparse":
            size = self.block_size
            if size is None or size < 16 or size > 256 or size & (size - 1):
                raise ValueError(f"mask block_sparse needs `block_size`, a power of 2 from 16 to 256 (got {size})")
        elif self.block_size is not None:
            raise ValueError(f"block_size is only for mask block_sparse, not {self.mask}")
        if self.latent_kv:
            self._check_latent()
        elif self.head_dim > 256:
            raise ValueError(f"head_dim {self.head_dim}: head_dim must be from 1 to 256 (up to {LATENT_MAX_HEAD_DIM} "
                             "only with latent_kv, the MLA decoding cache)")
        elif self.value_dim > 256:
            raise ValueError(f"value_head_dim {self.value_dim}: value_head_dim must be from 8 to 256 (up to "
                             f"{LATENT_MAX_VALUE_DIM} only with latent_kv, the MLA decoding cache)")
        if "decode" in self.passes and self.mask not in DECODE_MASKS:
            raise ValueError(f"the decode pass takes masks {', '.join(DECODE_MASKS)}, not {self.mask}")
        if "decode" in self.passes and self.dtype == "fp32" and self.head_dim % 8:
            raise ValueError(f"the decode pass in fp32 takes head dims that are multiples of 8, not {self.head_dim} "
                             "(fp16 and bf16 take any)")
        if "decode" in self.passes and self.tile_policy == "paper":
            raise ValueError("the decode pass has no paper tiles: use tile_policy auto")
        if "decode" in self.passes and "forward" not in self.passes and not self.latent_kv:
            raise ValueError("the decode pass serves forward calls with few query rows: passes must include forward")
        if self.layout == "packed" and "decode" in self.passes:
            raise ValueError("the decode pass reads a padded KV cache: use layout padded (with mask padding for "
                             "per-sequence lengths)")
        if self.mask_mod is not None or self.score_mod is not None or self.inputs:
            if "decode" in self.passes and self.mask_mod is not None:
                raise ValueError("the decode pass does not take mask_mod yet (score_mod it does): leave decode out of "
                                 "passes")
            from fagen.expressions import ExpressionError
            try:
                # rendered at this spec's softmax scale, which the kernels' form of score_mod divides constants by
                _modifiers(self.mask_mod, self.score_mod, self.inputs).cuda_struct("SpecMods", self.scale)
            except ExpressionError as err:
                raise ValueError(str(err)) from None
        if self.value_head_dim is not None:
            dims = f"head_dim {self.head_dim}, value_head_dim {self.value_head_dim}"
            if self.head_dim % 8 or self.value_head_dim % 8:
                raise ValueError(f"{dims}: a value_head_dim unlike head_dim takes multiples of 8 for both")
            if self.dtype == "fp32" or self.loop_order == "fa1" or self.tile_policy == "paper" or self.deterministic:
                raise ValueError(f"{dims}: a value_head_dim unlike head_dim runs on the tensor-core templates: dtype "
                                 f"fp16 or bf16, loop_order fa2, tile_policy auto, not deterministic (got {self.dtype}, "
                                 f"{self.loop_order}, {self.tile_policy}"
                                 + (", deterministic)" if self.deterministic else ")"))
        if self.dtype == "fp8_e4m3":
            self._check_fp8()
        if self.deterministic and "backward" not in self.passes:
            raise ValueError("deterministic only changes the backward pass, which passes does not include")
        return self

    def _check_fp8(self) -> None:
        """What an fp8_e4m3 spec takes: FP8 wgmma's k-steps of 32 bytes and V transposed in shared memory run on
        the Hopper forward template alone (forward_wgmma's fp8 family)."""
        where = "dtype fp8_e4m3"
        if tuple(self.passes) != FP8_PASSES:
            raise ValueError(f"{where}: passes {list(self.passes)} are not built yet: the fp8 forward alone "
                             "(passes [forward], the default for fp8_e4m3)")
        if not arch_features(self.arch).fp8_mma:
            raise ValueError(f"{where} runs on Hopper's FP8 wgmma: arch sm_90, not {self.arch}")
        if self.head_dim not in (64, 128, 192, 256):
            raise ValueError(f"{where} takes head_dim 64, 128, 192 or 256 (whole 64-byte rows), not {self.head_dim}")
        if self.value_head_dim is not None and self.value_head_dim != self.head_dim:
            raise ValueError(f"{where}: value_head_dim must equal head_dim (got {self.value_head_dim} and "
                             f"{self.head_dim})")
        if self.loop_order != "fa2" or self.tile_policy != "auto":
            raise ValueError(f"{where} runs on the tensor-core forward: loop_order fa2, tile_policy auto (got "
                             f"{self.loop_order}, {self.tile_policy})")
        if self.mask == "block_sparse" and self.block_size < 64:
            raise ValueError(f"{where}: mask block_sparse takes block_size 64, 128 or 256 (its key blocks are whole "
                             f"64-key panels of V^T), not {self.block_size}")

    def _check_latent(self) -> None:
        """What a latent_kv spec takes: the decode kernel that reads V as K's first columns (decode_latent_mma)."""
        where = "latent_kv"
        if self.value_head_dim is None or self.value_head_dim >= self.head_dim:
            raise ValueError(f"{where}: v is k's first value_head_dim columns, so value_head_dim must be set and below "
                             f"head_dim (MLA: head_dim 576, value_head_dim 512; got {self.head_dim}, "
                             f"{self.value_head_dim})")
        if self.head_dim % 32 or self.value_head_dim % 128:
            raise ValueError(f"{where}: head_dim a multiple of 32 and value_head_dim of 128 (O's columns split over 8 "
                             f"warps in 16-column tiles; got {self.head_dim}, {self.value_head_dim})")
        if tuple(self.passes) != LATENT_PASSES:
            raise ValueError(f"{where}: the latent cache is read by the decode pass alone, for any number of query rows: "
                             f"passes [decode] (got {list(self.passes)})")
        if self.dtype not in ("fp16", "bf16"):
            raise ValueError(f"{where} runs on tensor cores: dtype fp16 or bf16, not {self.dtype}")
        if self.layout != "padded":
            raise ValueError(f"{where}: layout padded (a paged cache through block_table), not {self.layout}")
        if self.dropout:
            raise ValueError(f"{where} is for inference: dropout 0, not {self.dropout}")
        if self.deterministic:
            raise ValueError(f"{where} decodes alone, with no backward for deterministic to change")

    # ---- derived values -------------------------------------------------------------------
    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    @property
    def value_dim(self) -> int:
        """The head dim of v, o, dO and dV: value_head_dim, or head_dim without one."""
        return self.value_head_dim or self.head_dim

    def tensor_dim(self, name: str) -> int:
        """The last dim of a call's tensor `name`: head_dim for q and k (and dq, dk), value_dim for v, o, dO, dV."""
        return self.head_dim if name in ("q", "k", "dq", "dk") else self.value_dim

    @property
    def compute_dim(self) -> int:
        """The widest of q's and v's head dims: the tiles' width (the narrower one's columns past its d are zeros)."""
        return max(self.head_dim, self.value_dim)

    @property
    def modifiers(self):
        """mask_mod, score_mod and inputs parsed (fagen.expressions.Modifiers; inactive without them)."""
        return _modifiers(self.mask_mod, self.score_mod, self.inputs)

    @property
    def kind_mask(self):
        """The mask kind as the expression its tests are generated from (fagen.expressions.mask_kind:
        causal, sliding_window), or None for the kinds that are data (none, padding, block_sparse)."""
        from fagen.expressions import mask_kind   # sympy: imported on first use, not with fagen.spec

        return mask_kind(self.mask, self.window or 0)

    @property
    def keys_grow_with_rows(self) -> bool:
        """Later query rows see more keys: causal, and any mask_mod (most hide the keys after the query:
        prefix-LM, windows with sinks, documents). The Hopper kernels then start the heaviest blocks first:
        forward_wgmma's row blocks last first, and the grid in groups of (sequence, head) pairs (runtime)."""
        return self.mask == "causal" or self.mask_mod is not None

    @property
    def kv_group_foldable(self) -> bool:
        """Nothing of the attention depends on the query head but its rows (no score_mod, no mask_mod that reads h,
        no dropout, no per-head block layout): a backward block may then walk every query head of a K/V head's group
        in turn, summing dK, dV in registers (where fagen/sources.py folds_kv_group builds it), padded or packed
        batches alike. And a head dim that is a multiple of 8: at d = 59 the folded loop spilled 44 B (ptxas, sm_90a)."""
        return (not self.dropout and self.mask != "block_sparse"
                and (not self.modifiers.active or self.modifiers.mask_alone_without_head) and self.head_dim % 8 == 0)

    @property
    def element_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def output_dtype(self) -> str:
        """o's dtype: q's, or bf16 for an fp8 forward."""
        return OUTPUT_DTYPES.get(self.dtype, self.dtype)

    @property
    def fp8(self) -> bool:
        """q, k, v in e4m3, read with run-time descale factors."""
        return self.dtype == "fp8_e4m3"

    @property
    def canonical_name(self) -> str:
        """A readable identifier that is a pure function of every field except `name`."""
        parts = [f"d{self.head_dim}" + (f"v{self.value_head_dim}" if self.value_head_dim else ""),
                 self.dtype.replace("_", ""), self.mask.replace("_", "")]
        if self.window is not None:
            parts[-1] += f"{self.window}"
        if self.block_size is not None:
            parts[-1] += f"{self.block_size}"
        if self.dropout:
            parts.append("drop" + _number_slug(self.dropout))
        parts += [self.loop_order, self.arch.replace("_", "")]
        if self.softmax_scale is not None:
            parts.append("scale" + _number_slug(self.softmax_scale))
        if self.sram_budget is not None:
            parts.append(f"m{self.sram_budget}")
        if self.tile_policy != "auto":
            parts.append(self.tile_policy)
        if self.passes != PASSES:
            parts.append("".join(p[:3] for p in self.passes))
        if self.deterministic:
            parts.append("det")
        if self.layout != "padded":
            parts.append(self.layout)
        if self.latent_kv:
            parts.append("latent")
        if self.mask_mod is not None or self.score_mod is not None or self.inputs:
            # the expressions are too long for a name: a digest of their text stands for them
            text = json.dumps([self.mask_mod, self.score_mod, self.inputs])
            parts.append("mod" + hashlib.sha256(text.encode()).hexdigest()[:8])
        return "_".join(parts)

    @property
    def variant_name(self) -> str:
        return self.name or self.canonical_name

    def to_dict(self) -> dict:
        """Every field, defaults included, JSON-ready."""
        data = self.model_dump(mode="json")
        data["passes"] = list(self.passes)
        for field in ("mask_mod", "score_mod", "inputs", "value_head_dim"):   # a spec without them reads as before them
            if data[field] is None:
                del data[field]
        if not data["latent_kv"]:   # (likewise: specs before latent_kv keep their cache keys)
            del data["latent_kv"]
        if self.inputs:
            data["inputs"] = dict(self.inputs)
        return data

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@functools.lru_cache(maxsize=256)
def _modifiers(mask_mod: Optional[str], score_mod: Optional[str], inputs: Optional[tuple]):
    from fagen.expressions import modifiers   # sympy: imported on first use, not with fagen.spec

    return modifiers(mask_mod, score_mod, dict(inputs) if inputs else None)


def _number_slug(value: float) -> str:
    return repr(float(value)).replace(".", "p").replace("-", "m").replace("+", "")


# ---- loading -------------------------------------------------------------------------------
def _field_names() -> list[str]:
    return list(Spec.model_fields)


def _short(value: Any, limit: int = 60) -> str:
    """repr(value) cut to `limit` characters, at bounded cost: a message stays one short line whatever the
    input (a YAML alias bomb expands to billions of values when printed whole; an int of 5,000 digits has no
    repr at all past Python's 4,300-digit limit)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class _Repr(reprlib.Repr):
    def repr_int(self, value, level):
        return _short(value) if value.bit_length() > 64 else repr(value)


_REPR = _Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxtuple, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 4, 4, 4, 50, 50

#: A spec file's values, counted with repetition (an alias counts each time it is used), may number this many
#: plus one per byte of the file (without aliases a value takes two bytes or more), and nest this deep
MAX_YAML_VALUES = 100_000
MAX_YAML_DEPTH = 32


def _format_error(error: dict, data: dict) -> str:
    loc = ".".join(str(part) for part in error.get("loc", ())) or "spec"
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        guess = difflib.get_close_matches(str(error["loc"][-1]), _field_names(), n=1)
        hint = f"; did you mean '{guess[0]}'?" if guess else f"; allowed fields: {', '.join(_field_names())}"
        return f"unknown field {_short(str(error['loc'][-1]))}{hint}"
    if kind == "missing":
        return f"field '{loc}' is required"
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if kind in _STRICT_TYPES:
        message = _STRICT_TYPES[kind]
    if kind == "literal_error":
        return f"{loc}: {_short(error.get('input'))} is not allowed: {message}"
    top = error["loc"][0] if error.get("loc") else None
    if top in data and kind != "value_error":
        return f"{loc}: {_short(data[top])} is not allowed: {message}"
    if top in data:
        return f"{loc}: {message}"
    return message


#: pydantic's strict-type errors, said in the spec's words: a boolean or a string is never read as a number
_STRICT_TYPES = {
    "int_type": "it must be an integer (not a boolean, a string or a fraction)",
    "float_type": "it must be a number (not a boolean or a string)",
    "bool_type": "it must be true or false (not a number or a string)",
    "string_type": "it must be a string",
}


def _validation_message(err: ValidationError, data: dict) -> str:
    # An unknown key usually explains a "missing" one (a typo), so it is reported first.
    errors = sorted(err.errors(), key=lambda e: e.get("type") != "extra_forbidden")
    return " ".join(_format_error(errors[0], data).split())


def spec_from_dict(data: Any, where: str = "spec") -> Spec:
    """Validate one mapping; on failure raise SpecError with a one-line, located message."""
    if isinstance(data, Spec):
        return data
    if not isinstance(data, dict):
        raise SpecError(f"{where}: a spec is a mapping of fields, got {type(data).__name__}")
    if not all(isinstance(key, str) for key in data):
        bad = next(key for key in data if not isinstance(key, str))
        raise SpecError(f"{where}: field names are strings, got {_short(bad)}")
    try:
        return Spec(**data)
    except SpecError as err:
        raise SpecError(f"{where}: {err.detail}") from None


@functools.lru_cache(maxsize=1)
def _spec_loader():
    """PyYAML's safe loader, refusing a mapping that names a key twice (plain YAML keeps the last silently).
    Keys merged in from an alias (`<<: *base`) may be overridden: that is what merging is for. libyaml's parser
    where PyYAML has it: 5x faster on big files, and it refuses absurd nesting without recursing. Built on first
    use: a process that only loads compiled kernels never imports YAML."""
    import yaml

    class SpecLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    duplicate = key in seen
                except TypeError:   # an unhashable key: the base constructor says so
                    continue
                if duplicate:
                    raise yaml.constructor.ConstructorError(None, None, f"the key {_short(key)} appears twice",
                                                            key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return SpecLoader


def _check_size(data: Any, path: Path, nbytes: int) -> None:
    """Walks the loaded document, counting values with repetition, and stops at the first bound passed."""
    count, stack, most = 0, [(data, 1)], MAX_YAML_VALUES + nbytes
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > most:
            raise SpecError(f"{path}: holds more than {most:,} values, counting each use of an alias (a YAML "
                            "alias bomb?): a spec file is a few fields per variant")
        if depth > MAX_YAML_DEPTH:
            raise SpecError(f"{path}: is nested more than {MAX_YAML_DEPTH} levels deep")
        if isinstance(value, dict):
            stack.extend((item, depth + 1) for pair in value.items() for item in pair)
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)


def load_specs(path: Union[str, Path]) -> list[Spec]:
    """A YAML file holding one spec (a mapping) or a list of variants."""
    import yaml

    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise SpecError(f"{path}: cannot read spec file: {err.strerror or err}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise SpecError(f"{path}: is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); save it "
                        "as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_spec_loader())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        problem = getattr(err, "problem", None) or err
        raise SpecError(" ".join(f"{path}:{line}: not valid YAML: {problem}".split())) from None
    except RecursionError:
        raise SpecError(f"{path}: is nested too deeply to be a spec") from None
    except ValueError as err:   # PyYAML's int() of a number longer than Python's 4,300-digit limit
        what = "a number of more than 4,300 digits" if "digits" in str(err) else " ".join(str(err).split())[:120]
        raise SpecError(f"{path}: holds a value that cannot be read: {what}") from None
    if data is None:
        raise SpecError(f"{path}: holds no spec (the file is empty)")
    _check_size(data, path, len(raw))
    if isinstance(data, dict) and "variants" in data and len(data) == 1:
        data = data["variants"]
    items = data if isinstance(data, list) else [data]
    if not items:
        raise SpecError(f"{path}: holds no spec")
    specs = [spec_from_dict(item, f"{path}: variant {n + 1}" if len(items) > 1 else str(path))
             for n, item in enumerate(items)]
    seen: dict[str, int] = {}
    for n, spec in enumerate(specs):
        first = seen.setdefault(spec.variant_name, n)
        if first != n:
            raise SpecError(f"{path}: variants {first + 1} and {n + 1} share the name {spec.variant_name}; give each "
                            "a distinct `name`")
    return specs


def json_schema() -> dict:
    schema = Spec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "fagen attention spec"
    single = dict(schema)
    defs = single.pop("$defs", None)
    out = {"$schema": schema["$schema"], "title": schema["title"],
           "oneOf": [{"$ref": "#/$defs/Spec"}, {"type": "array", "items": {"$ref": "#/$defs/Spec"}, "minItems": 1}],
           "$defs": {**(defs or {}), "Spec": {k: v for k, v in single.items() if k not in ("$schema",)}}}
    return out
