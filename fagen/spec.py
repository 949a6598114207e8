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
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, field_validator,
                      model_validator)

DTYPES = ("fp16", "bf16", "fp32")
MASKS = ("none", "causal", "sliding_window", "padding", "block_sparse")
LOOP_ORDERS = ("fa1", "fa2")
ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
PASSES = ("forward", "backward")          # the default: what a spec builds unless `passes` says otherwise
ALL_PASSES = PASSES + ("decode",)         # decode: the split-KV forward for few query rows (opt-in)
DECODE_MASKS = ("none", "causal", "sliding_window", "padding")
TILE_POLICIES = ("paper", "auto")
LAYOUTS = ("padded", "packed")
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
MIN_DROPOUT = 2.0**-16   # the kernels keep an element iff its 16-bit draw >= floor(p * 2**16): a smaller p drops nothing

_SIZE_UNITS = {"": 1, "b": 1, "kb": 1000, "kib": 1024, "mb": 1000**2, "mib": 1024**2}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmM]?i?[bB]?)\s*$")


class SpecError(ValueError):
    """A spec that cannot be built; the message is one line naming file, field, value and what is allowed."""


def parse_bytes(value: Union[int, str]) -> int:
    """`49152`, `"48KiB"`, `"48 KB"` -> bytes."""
    if isinstance(value, bool):
        raise ValueError("must be a number of bytes or a size such as '48KiB'")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    match = _SIZE_RE.match(str(value))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"{value!r} is not a size: write bytes (49152) or a size such as '48KiB' or '96KB'")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[unit.lower()])


class Spec(BaseModel):
    """One attention variant. Field docs become the JSON Schema's descriptions (`fagen schema`)."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True)

    name: Optional[str] = Field(None, description="Variant name; default derived from every other field.")
    head_dim: int = Field(..., description="Head dimension d: any from 1 to 256.")
    dtype: Literal["fp16", "bf16", "fp32"] = Field("fp16", description="Element type of q, k, v and o.")
    mask: Literal["none", "causal", "sliding_window", "padding", "block_sparse"] = Field(
        "none", description="Which (query, key) pairs are visible.")
    window: Optional[int] = Field(
        None, description="sliding_window only: each query sees itself and the window-1 keys before it.")
    block_size: Optional[int] = Field(
        None, description="block_sparse only: granularity of the run-time block layout (16..256, power of 2).")
    dropout: float = Field(0.0, description="Dropout probability on the attention weights: 0, or in [2**-16, 1) "
                                            "(applied as floor(p * 65536) / 65536).")
    softmax_scale: Optional[float] = Field(None, description="Scale tau applied to Q.K^T; default 1/sqrt(head_dim).")
    loop_order: Literal["fa1", "fa2"] = Field(
        "fa2", description="fa1: K/V blocks outer, O/l/m in HBM (FlashAttention-1). fa2: Q blocks outer.")
    sram_budget: Optional[Union[int, str]] = Field(
        None, description="Shared memory per block in bytes or as '48KiB'; default: the target's per-block limit.")
    tile_policy: Literal["paper", "auto"] = Field(
        "auto", description="paper: the FlashAttention-1 closed form; auto: the template's own footprint.")
    arch: Literal["sm_80", "sm_86", "sm_89", "sm_90"] = Field("sm_90", description="GPU architecture to build for.")
    passes: tuple[Literal["forward", "backward", "decode"], ...] = Field(
        ("forward", "backward"), description="Which kernels to generate: forward, backward, and decode (the "
        "split-KV forward that calls with few query rows, group x Nq <= 16, take instead of forward).")
    deterministic: bool = Field(False, description="Backward without atomics: bitwise-reproducible dq.")
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
        if isinstance(value, bool) or not (1 <= value <= 256):
            raise ValueError(f"{value} is not allowed: head_dim must be from 1 to 256")
        return value

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
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{value} is not allowed: softmax_scale must be a positive finite number")
        return value

    @field_validator("sram_budget")
    @classmethod
    def _budget(cls, value: Union[int, str, None]) -> Optional[int]:
        if isinstance(value, bool):
            raise ValueError(f"{value!r} is not a size: write bytes (49152) or a size such as '48KiB'")
        if value is None:
            return None
        nbytes = parse_bytes(value)
        if nbytes <= 0:
            raise ValueError(f"{value!r} is not allowed: sram_budget must be positive")
        return nbytes

    @field_validator("passes", mode="before")
    @classmethod
    def _passes(cls, value: Any) -> Any:
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError("at least one of forward, backward, decode is needed")
            if len(set(value)) != len(value):
                raise ValueError(f"{list(value)} names a pass twice")
            return tuple(sorted(value, key=lambda p: ALL_PASSES.index(p) if p in ALL_PASSES else 99))
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: Optional[str]) -> Optional[str]:
        if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]{0,80}", value):
            raise ValueError(f"{value!r} is not allowed: a name is a C identifier (letters, digits, _)")
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
                inputs = data.get("inputs")
                inputs = dict(inputs) if isinstance(inputs, (dict, list, tuple)) else None
                try:
                    data = {**data, field: as_text(value, field, inputs)}
                except (ExpressionError, TypeError) as err:
                    raise ValueError(str(err)) from None
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
            try:
                return tuple(sorted((tuple(pair) for pair in value), key=lambda pair: str(pair[0])))
            except TypeError:
                return value   # not pairs: pydantic's own message names what is wrong
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
        if "decode" in self.passes and self.mask not in DECODE_MASKS:
            raise ValueError(f"the decode pass takes masks {', '.join(DECODE_MASKS)}, not {self.mask}")
        if "decode" in self.passes and self.dtype == "fp32" and self.head_dim % 8:
            raise ValueError(f"the decode pass in fp32 takes head dims that are multiples of 8, not {self.head_dim} "
                             "(fp16 and bf16 take any)")
        if "decode" in self.passes and self.tile_policy == "paper":
            raise ValueError("the decode pass has no paper tiles: use tile_policy auto")
        if "decode" in self.passes and "forward" not in self.passes:
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
        if self.deterministic and "backward" not in self.passes:
            raise ValueError("deterministic only changes the backward pass, which passes does not include")
        return self

    # ---- derived values -------------------------------------------------------------------
    @property
    def scale(self) -> float:
        return self.softmax_scale if self.softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

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
    def canonical_name(self) -> str:
        """A readable identifier that is a pure function of every field except `name`."""
        parts = [f"d{self.head_dim}", self.dtype, self.mask.replace("_", "")]
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
        for field in ("mask_mod", "score_mod", "inputs"):   # a spec without expressions reads as before them
            if data[field] is None:
                del data[field]
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


def _format_error(error: dict, data: dict, where: str) -> str:
    loc = ".".join(str(part) for part in error.get("loc", ())) or "spec"
    kind = error.get("type", "")
    if kind == "extra_forbidden":
        guess = difflib.get_close_matches(str(error["loc"][-1]), _field_names(), n=1)
        hint = f"; did you mean '{guess[0]}'?" if guess else f"; allowed fields: {', '.join(_field_names())}"
        return f"{where}: unknown field '{loc}'{hint}"
    if kind == "missing":
        return f"{where}: field '{loc}' is required"
    message = str(error.get("msg", "invalid")).removeprefix("Value error, ")
    if kind == "literal_error":
        given = error.get("input")
        return f"{where}: {loc}: {given!r} is not allowed: {message}"
    top = error["loc"][0] if error.get("loc") else None
    if top in data and kind != "value_error":
        return f"{where}: {loc}: {data[top]!r} is not allowed: {message}"
    if top in data:
        return f"{where}: {loc}: {message}"
    return f"{where}: {message}"


def spec_from_dict(data: Any, where: str = "spec") -> Spec:
    """Validate one mapping; on failure raise SpecError with a one-line, located message."""
    if isinstance(data, Spec):
        return data
    if not isinstance(data, dict):
        raise SpecError(f"{where}: a spec is a mapping of fields, got {type(data).__name__}")
    try:
        return Spec(**data)
    except ValidationError as err:
        # An unknown key usually explains a "missing" one (a typo), so it is reported first.
        errors = sorted(err.errors(), key=lambda e: e.get("type") != "extra_forbidden")
        raise SpecError(_format_error(errors[0], data, where)) from None
    except TypeError as err:  # non-string keys
        raise SpecError(f"{where}: {err}") from None


def load_specs(path: Union[str, Path]) -> list[Spec]:
    """A YAML file holding one spec (a mapping) or a list of variants."""
    import yaml   # here, not at the top: a process that only loads compiled kernels never parses YAML

    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise SpecError(f"{path}: cannot read spec file: {err.strerror or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark else ""
        raise SpecError(f"{path}:{line}: not valid YAML: {getattr(err, 'problem', err)}") from None
    if data is None:
        raise SpecError(f"{path}: holds no spec (the file is empty)")
    if isinstance(data, dict) and "variants" in data and len(data) == 1:
        data = data["variants"]
    items = data if isinstance(data, list) else [data]
    if not items:
        raise SpecError(f"{path}: holds no spec")
    specs = [spec_from_dict(item, f"{path}: variant {n + 1}" if len(items) > 1 else str(path))
             for n, item in enumerate(items)]
    names = [s.variant_name for s in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise SpecError(f"{path}: two variants share the name {dupes[0]}; give each a distinct `name`")
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
