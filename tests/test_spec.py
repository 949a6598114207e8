"""The spec: YAML loading, located validation messages, sizes, the canonical name and the JSON Schema."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from fagen.spec import (ARCHS, DTYPES, DTYPES_EVERY_PASS, LAYOUTS, LOOP_ORDERS, MASKS, MIN_DROPOUT, PASSES, TILE_POLICIES, Spec, SpecError, json_schema,
                        load_specs, parse_bytes, spec_from_dict)

def _jsonschema():
    """The test extra's validator, imported where a test uses it (the GPU image, which runs this module too, lacks it)."""
    return pytest.importorskip("jsonschema")


EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_specs(path)
    message = str(info.value)
    assert "\n" not in message, "a spec error is one line"
    assert message.startswith(str(path)), "a spec error names the file"
    return message


# ---- loading --------------------------------------------------------------------------------
def test_single_mapping_is_one_variant(tmp_path):
    (spec,) = load_specs(write(tmp_path, "head_dim: 64\ndtype: bf16\nmask: causal\n"))
    assert (spec.head_dim, spec.dtype, spec.mask) == (64, "bf16", "causal")
    # Defaults are filled in and documented in the README.
    assert (spec.loop_order, spec.tile_policy, spec.arch, spec.passes) == ("fa2", "auto", "sm_90", PASSES)
    assert spec.dropout == 0.0 and spec.softmax_scale is None and spec.sram_budget is None
    assert spec.scale == pytest.approx(1 / 8)


def test_list_is_variants_in_order(tmp_path):
    specs = load_specs(write(tmp_path, """
- head_dim: 64
- head_dim: 128
  dtype: fp32
  mask: sliding_window
  window: 256
- name: sparse
  head_dim: 32
  mask: block_sparse
  block_size: 64
  dropout: 0.1
  loop_order: fa1
  passes: [forward]
"""))
    assert [s.head_dim for s in specs] == [64, 128, 32]
    assert specs[1].window == 256 and specs[2].block_size == 64
    assert specs[2].variant_name == "sparse" and specs[2].passes == ("forward",)
    assert specs[0].variant_name == specs[0].canonical_name


def test_spec_is_frozen():
    spec = Spec(head_dim=64)
    with pytest.raises(Exception):
        spec.head_dim = 128  # type: ignore[misc]


def test_duplicate_variant_names_rejected(tmp_path):
    message = error_of(tmp_path, "- {head_dim: 64, name: a}\n- {head_dim: 128, name: a}\n")
    assert "name" in message and "a" in message


# ---- one clear message per bad field ------------------------------------------------------------
BAD_FIELDS = [
    # (yaml, field named, words that must appear: the value and what is allowed)
    ("head_dim: 0", "head_dim", ["0", "from 1 to 256"]),
    ("head_dim: 264", "head_dim", ["264", "from 1 to 256"]),
    ("head_dim: 64\ndtype: fp8", "dtype", ["fp8", *DTYPES]),
    ("head_dim: 64\nmask: diagonal", "mask", ["diagonal", *MASKS]),
    ("head_dim: 64\nloop_order: fa3", "loop_order", ["fa3", *LOOP_ORDERS]),
    ("head_dim: 64\narch: sm_70", "arch", ["sm_70", *ARCHS]),
    ("head_dim: 64\ntile_policy: greedy", "tile_policy", ["greedy", *TILE_POLICIES]),
    ("head_dim: 64\npasses: [fwd]", "passes", ["fwd", *PASSES]),
    ("head_dim: 64\ndropout: 1.0", "dropout", ["1.0", "[0, 1)"]),
    ("head_dim: 64\ndropout: -0.5", "dropout", ["-0.5", "[0, 1)"]),
    ("head_dim: 64\ndropout: 1.0e-6", "dropout", ["1e-06", "2**-16"]),
    ("head_dim: 64\nsoftmax_scale: -1", "softmax_scale", ["-1", "positive"]),
    ("head_dim: 64\nsram_budget: lots", "sram_budget", ["lots", "48KiB"]),
    ("head_dim: 64\nname: 1bad", "name", ["1bad", "identifier"]),
    ("head_dim: 64\nmask: sliding_window", "window", ["sliding_window"]),
    ("head_dim: 64\nmask: sliding_window\nwindow: 0", "window", ["positive"]),
    ("head_dim: 64\nwindow: 128", "window", ["sliding_window"]),
    ("head_dim: 64\nmask: block_sparse\nblock_size: 48", "block_size", ["48", "power of 2", "16", "256"]),
    ("head_dim: 64\nblock_size: 64", "block_size", ["block_sparse"]),
    ("dtype: bf16", "head_dim", ["required"]),
]


@pytest.mark.parametrize("text, field, words", BAD_FIELDS, ids=[f"{f}:{t.splitlines()[-1]}" for t, f, _ in BAD_FIELDS])
def test_bad_field_names_file_field_value_and_allowed(tmp_path, text, field, words):
    message = error_of(tmp_path, text + "\n")
    assert field in message
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_bad_field_in_a_list_names_the_variant(tmp_path):
    message = error_of(tmp_path, "- head_dim: 64\n- head_dim: 700\n")
    assert "variant 2" in message and "head_dim" in message and "700" in message


def test_unknown_key_did_you_mean(tmp_path):
    message = error_of(tmp_path, "head_dim: 64\ndtyp: bf16\n")
    assert "unknown field 'dtyp'" in message and "did you mean 'dtype'" in message


def test_unknown_key_without_close_match_lists_fields(tmp_path):
    message = error_of(tmp_path, "head_dim: 64\ncolour: blue\n")
    assert "colour" in message and "head_dim" in message and "loop_order" in message


def test_misspelt_required_key_did_you_mean(tmp_path):
    message = error_of(tmp_path, "head_dimm: 64\n")
    assert "did you mean 'head_dim'" in message


@pytest.mark.parametrize("text, words", [
    ("head_dim: [64\n", ["not valid YAML", "line"]),
    ("- 64\n- 128\n", ["mapping"]),
    ("", ["holds no spec", "empty"]),
])
def test_malformed_files(tmp_path, text, words):
    message = error_of(tmp_path, text)
    for word in words:
        assert word in message


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="nope.yaml.*cannot read"):
        load_specs(tmp_path / "nope.yaml")


# ---- sizes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("text, nbytes", [
    ("48KiB", 48 * 1024), ("48 KiB", 48 * 1024), ("96KB", 96_000), ("64kib", 64 * 1024),
    ("1MiB", 1 << 20), ("1.5KiB", 1536), ("49152", 49152), (49152, 49152),
])
def test_sizes(text, nbytes):
    assert parse_bytes(text) == nbytes


def test_size_in_yaml_is_normalised_to_bytes(tmp_path):
    (spec,) = load_specs(write(tmp_path, "head_dim: 64\nsram_budget: 48KiB\n"))
    assert spec.sram_budget == 49152
    assert spec == Spec(head_dim=64, sram_budget=49152)
    assert spec.canonical_name == Spec(head_dim=64, sram_budget="48 KiB").canonical_name


@pytest.mark.parametrize("value", ["0KiB", "-5", "48 parsecs", "KiB"])
def test_bad_sizes(value):
    with pytest.raises(Exception):
        Spec(head_dim=64, sram_budget=value)


# ---- the canonical name: a pure, injective function of every field but `name` -------------------
@st.composite
def spec_fields(draw) -> dict:
    fields = {
        "head_dim": draw(st.sampled_from(range(32, 257, 8))),
        "dtype": draw(st.sampled_from(DTYPES_EVERY_PASS)),
        "loop_order": draw(st.sampled_from(LOOP_ORDERS)),
        "tile_policy": draw(st.sampled_from(TILE_POLICIES)),
        "arch": draw(st.sampled_from(ARCHS)),
        "dropout": draw(st.just(0.0) | st.sampled_from([0.1, 0.2, 0.5]) | st.floats(MIN_DROPOUT, 1, exclude_max=True)),
        "softmax_scale": draw(st.none() | st.floats(1e-3, 1e3)),
        "sram_budget": draw(st.none() | st.integers(1, 1 << 18)),
    }
    fields.update(draw(mask_fields()))
    fields.update(draw(pass_fields()))
    return fields


@st.composite
def mask_fields(draw) -> dict:
    mask = draw(st.sampled_from(MASKS))
    out = {"mask": mask}
    if mask == "sliding_window":
        out["window"] = draw(st.integers(1, 1 << 16))
    if mask == "block_sparse":
        out["block_size"] = draw(st.sampled_from([16, 32, 64, 128, 256]))
    return out


@st.composite
def pass_fields(draw) -> dict:
    passes = draw(st.sampled_from([("forward", "backward"), ("forward",), ("backward",)]))
    return {"passes": passes, "deterministic": "backward" in passes and draw(st.booleans())}


# Fields that only make sense together are swapped as a group.
GROUPS = [("head_dim",), ("dtype",), ("loop_order",), ("tile_policy",), ("arch",), ("dropout",), ("softmax_scale",),
          ("sram_budget",), ("mask", "window", "block_size"), ("passes", "deterministic")]


@settings(deadline=None)
@given(a=spec_fields(), b=spec_fields(), take=st.lists(st.booleans(), min_size=len(GROUPS), max_size=len(GROUPS)),
       name=st.none() | st.from_regex(r"[a-z_][a-z0-9_]{0,20}", fullmatch=True))
def test_canonical_name_is_injective_pure_function_of_fields(a, b, take, name):
    # b shares a random subset of a's field groups, so near-equal specs are drawn as often as distinct ones.
    mixed = {}
    for group, from_b in zip(GROUPS, take):
        source = b if from_b else a
        mixed.update({key: source[key] for key in group if key in source})
    first, second = Spec(**a), Spec(**mixed, name=name)
    same_fields = {k: v for k, v in first.to_dict().items() if k != "name"} == \
                  {k: v for k, v in second.to_dict().items() if k != "name"}
    assert (first.canonical_name == second.canonical_name) == same_fields
    assert first.canonical_name == Spec(**a).canonical_name  # pure: same fields, same name
    assert second.canonical_name == Spec(**mixed).canonical_name  # `name` does not enter it
    assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", first.canonical_name), "the name is a C identifier"
    assert second.variant_name == (name or second.canonical_name)


@pytest.mark.parametrize("field", ["dropout", "softmax_scale"])
def test_canonical_name_separates_close_floats(field):
    first, second = Spec(head_dim=64, **{field: 0.1234567}), Spec(head_dim=64, **{field: 0.1234568})
    assert first != second
    assert first.canonical_name != second.canonical_name


def test_canonical_name_is_readable():
    spec = Spec(head_dim=64, dtype="bf16", mask="causal", loop_order="fa2", arch="sm_90")
    assert spec.canonical_name == "d64_bf16_causal_fa2_sm90"


# ---- the JSON Schema ------------------------------------------------------------------------------
def test_schema_is_a_valid_json_schema():
    _jsonschema().Draft202012Validator.check_schema(json_schema())


def test_examples_exist_and_cover_the_spec():
    specs = [spec for path in EXAMPLES for spec in load_specs(path)]
    # every example compiles twice in CI (sm_80, sm_90; fp8 once, sm_90 alone): keep the list short
    assert 12 <= len(specs) and sum(1 if s.fp8 else 2 for s in specs) <= 60
    assert {s.mask for s in specs} == set(MASKS)
    assert {s.dtype for s in specs} == set(DTYPES)
    assert {s.loop_order for s in specs} == set(LOOP_ORDERS)
    assert {s.layout for s in specs} == set(LAYOUTS)
    assert {32, 64, 96, 128, 256} <= {s.head_dim for s in specs}
    assert any(s.dropout > 0 for s in specs)
    assert any(len(load_specs(path)) > 1 for path in EXAMPLES), "one example file holds a list of variants"
    names = [s.variant_name for s in specs]
    assert len(names) == len(set(names)), "example variants share a name (generated/ would clash)"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_schema_validates_the_examples(path):
    _jsonschema().validate(yaml.safe_load(path.read_text()), json_schema())


@pytest.mark.parametrize("document", [
    {"head_dim": 64, "dtyp": "bf16"},
    {"head_dim": 64, "dtype": "fp8"},
    {"head_dim": 64, "mask": "diagonal"},
    {"dtype": "bf16"},
    [],
])
def test_schema_rejects_what_the_loader_rejects(document):
    with pytest.raises(_jsonschema().ValidationError):
        _jsonschema().validate(document, json_schema())


@pytest.mark.parametrize("fields, words", [
    ({"head_dim": 59, "dtype": "fp32", "passes": ["forward", "decode"]}, ["decode", "fp32", "multiples of 8"]),
    ({"head_dim": 64, "tile_policy": "paper", "passes": ["forward", "decode"]}, ["decode", "paper"]),
    ({"head_dim": 64, "passes": ["decode"]}, ["decode", "forward"]),
    ({"head_dim": 64, "mask": "block_sparse", "block_size": 64, "passes": ["forward", "decode"]}, ["decode", "block_sparse"]),
])
def test_decode_combinations_no_template_builds_are_rejected_up_front(fields, words):
    with pytest.raises(ValueError) as err:
        Spec(**fields)
    for word in words:
        assert word in str(err.value)


def test_packed_layout_is_named_and_excludes_decode():
    spec = Spec(head_dim=128, dtype="bf16", mask="causal", layout="packed")
    assert spec.canonical_name.endswith("_packed") and spec.canonical_name != Spec(head_dim=128, dtype="bf16",
                                                                                     mask="causal").canonical_name
    with pytest.raises(SpecError, match="decode pass reads a padded KV cache"):
        spec_from_dict({"head_dim": 128, "layout": "packed", "passes": ["forward", "decode"]})
    with pytest.raises(SpecError, match="layout"):
        spec_from_dict({"head_dim": 128, "layout": "ragged"})


# ---- mask_mod / score_mod / inputs ---------------------------------------------------------------
def test_modifier_fields_round_trip_and_name_the_variant():
    fields = {"head_dim": 64, "dtype": "bf16", "mask": "causal", "score_mod": "cap * tanh(score / cap)",
              "inputs": {"cap": "scalar"}}
    spec = spec_from_dict(fields)
    assert spec.inputs == (("cap", "scalar"),)
    assert spec.to_dict()["inputs"] == {"cap": "scalar"}
    assert spec_from_dict(spec.to_dict()) == spec
    assert hash(spec) == hash(spec_from_dict(spec.to_dict()))
    plain = Spec(head_dim=64, dtype="bf16", mask="causal")
    assert spec.canonical_name.startswith(plain.canonical_name + "_mod")
    other = spec_from_dict({**fields, "score_mod": "cap * tanh(score / (2 * cap))"})
    assert other.canonical_name != spec.canonical_name
    assert "mask_mod" not in plain.to_dict(), "specs without expressions keep their record as before"


@pytest.mark.parametrize("fields, words", [
    ({"mask_mod": "j <= k"}, ["mask_mod", "'k'"]),
    ({"mask_mod": "i + j"}, ["mask_mod", "boolean"]),
    ({"score_mod": "score + bias[i]"}, ["bias"]),
    ({"score_mod": "__import__('os')"}, ["score_mod"]),
    ({"mask_mod": "j <= i", "passes": ["forward", "decode"]}, ["decode"]),
    ({"mask_mod": "  "}, ["mask_mod", "empty"]),
])
def test_bad_modifiers_get_one_line_errors(fields, words):
    with pytest.raises(SpecError) as err:
        spec_from_dict({"head_dim": 64, **fields})
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_decode_takes_score_mod_but_not_mask_mod():
    spec = Spec(head_dim=64, score_mod="score - slope[h] * (i - j)", inputs={"slope": "float32"},
                passes=["forward", "decode"])
    assert "decode" in spec.passes
    with pytest.raises(ValueError, match="decode pass does not take mask_mod"):
        Spec(head_dim=64, mask_mod="j <= i", score_mod="score * 2", passes=["forward", "decode"])


def test_schema_accepts_inputs_as_a_mapping():
    document = {"head_dim": 64, "score_mod": "score + bias[h, i - j]", "inputs": {"bias": "float32"}}
    _jsonschema().validate(document, json_schema())
    with pytest.raises(_jsonschema().ValidationError):
        _jsonschema().validate({**document, "inputs": {"bias": "float64"}}, json_schema())


def test_inputs_mean_the_same_slots_whatever_order_they_are_declared_in():
    """The kernel's input slots follow the spec's inputs, which are sorted by name: two declarations in
    different orders are one spec (one cache entry, one kernel), and a spec read back from its JSON
    is the same spec."""
    fields = {"head_dim": 64, "score_mod": "score * a + b2[h] - c[i]"}
    one = spec_from_dict({**fields, "inputs": {"c": "float32", "a": "scalar", "b2": "float32"}})
    two = spec_from_dict({**fields, "inputs": {"a": "scalar", "b2": "float32", "c": "float32"}})
    assert one == two and one.canonical_name == two.canonical_name and one.canonical_json() == two.canonical_json()
    assert spec_from_dict(json.loads(one.canonical_json())) == one
    assert [name for name, _, _ in one.modifiers.tensors] == ["b2", "c"] and one.modifiers.scalars == ("a",)


def test_score_mod_constant_that_overflows_at_the_spec_scale_is_refused():
    """The kernels apply score_mod as score_mod(tau s) / tau, which divides constants by tau: one that fits in a
    float in the user's units but not after that division must be refused, not rendered as inf."""
    assert Spec(head_dim=64, dtype="bf16", score_mod="score - 3e37").modifiers.active
    with pytest.raises(ValueError) as err:
        Spec(head_dim=64, dtype="bf16", score_mod="score - 3e38")
    assert "softmax scale 0.125" in str(err.value) and "does not fit in a float" in str(err.value)


# ---- hardening: every input from issue 60's tables gets one line, fast -------------------------------
def _one_line_spec_error(make) -> str:
    """make() must raise SpecError (one line) well before a hang would show (the inputs of issue 60's tables hung
    for minutes; 5 s leaves room for a loaded CI machine); returns the message."""
    import time

    start = time.perf_counter()
    with pytest.raises(SpecError) as info:
        make()
    assert time.perf_counter() - start < 5.0, "a bad spec is refused at once"
    message = str(info.value)
    assert "\n" not in message and len(message) < 400, message
    return message


@pytest.mark.parametrize("fields, words", [
    ({"head_dimm": 64}, ["unknown field 'head_dimm'", "did you mean 'head_dim'"]),
    ({"head_dim": True}, ["head_dim", "True", "integer"]),
    ({"head_dim": "64"}, ["head_dim", "'64'", "integer"]),
    ({"head_dim": 64, "deterministic": "yes"}, ["deterministic", "true or false"]),
    ({"head_dim": 64, "deterministic": 1}, ["deterministic", "true or false"]),
    ({"head_dim": 64, "dropout": True}, ["dropout", "number"]),
    ({"head_dim": 64, "dropout": "0.1"}, ["dropout", "number"]),
    ({"head_dim": 64, "name": "a" * 82}, ["82 characters", "at most 81"]),
    ({"head_dim": 64, "name": "caf\u00e9"}, ["C identifier", "ASCII"]),
    ({"head_dim": 64, "inputs": [[]]}, ["inputs", "mapping of input names to kinds"]),
    ({"head_dim": 64, "mask": "sliding_window", "window": 2**31}, ["window", "2147483648", "2**31 - 1"]),
    ({"head_dim": 64, "softmax_scale": 1e300}, ["softmax_scale", "float32"]),
    ({"head_dim": 64, "sram_budget": "1" + "0" * 309}, ["sram_budget", "not a size"]),
    ({"head_dim": 64, "sram_budget": 10**40}, ["sram_budget", "2 GiB"]),
    ({"head_dim": 64, "score_mod": "score + 2**10**10"}, ["score_mod", "32 bits"]),
    ({"head_dim": 64, "score_mod": "score + 2**2**2**2**2**2"}, ["score_mod", "exponent", "too large"]),
    ({"head_dim": 64, "mask_mod": "i < 9**9**9**9"}, ["mask_mod", "exponent"]),
    ({"head_dim": 64, "score_mod": "score ** 2 ** 100"}, ["score_mod", "32 bits"]),
    ({"head_dim": 64, "score_mod": "score + exp(1000)"}, ["score_mod", "exp(1000)", "overflows float32"]),
    ({"head_dim": 64, "score_mod": "score * 2.0 ** -200"}, ["score_mod", "exponent", "too large"]),
    ({"head_dim": 64, "score_mod": "score * 0.5 ** 100 * 0.5 ** 100"}, ["score_mod", "rounds to 0"]),
    ({"head_dim": 64, "score_mod": "score * 1e30 * 1e30"}, ["score_mod", "1e+60", "overflows float32"]),
    ({"head_dim": 64, "score_mod": "score" + " + score" * 5000}, ["score_mod", "characters long"]),
    ({"head_dim": 64, "score_mod": "score" + " + 1" * 3000}, ["score_mod", "characters long"]),
    ({"head_dim": 64, "score_mod": "-" * 10000 + "score"}, ["score_mod", "characters long"]),
    ({"head_dim": 64, "score_mod": "-" * 1990 + "score"}, ["score_mod", "terms and operators"]),
    ({"head_dim": 64, "mask_mod": "not " * 5000 + "i < j"}, ["mask_mod", "characters long"]),
    ({"head_dim": 64, "mask_mod": "sqrt(" * 50 + "i" + ")" * 50 + " < j"}, ["mask_mod", "nested", "levels deep"]),
    ({"head_dim": 64, "mask_mod": "j <= i # \\"}, ["mask_mod", "backslash"]),
    ({"head_dim": 64, "score_mod": "sigmoid(" * 30 + "score" + ")" * 30}, ["nested too deeply"]),
    ({"head_dim": 64, "score_mod": "score * exp(80) * exp(80)"}, ["score_mod", "exp(160)", "overflows float32"]),
    ({"head_dim": 64, "score_mod": "score / exp(80) / exp(80)"}, ["score_mod", "rounds to 0"]),
    ({"head_dim": 64, "score_mod": "score * 2**20 * 2**20"}, ["score_mod", "1099511627776", "32 bits"]),
    ({"head_dim": 10**5000}, ["head_dim", "an integer of 16610 bits"]),
    ({"head_dim": 64, "name": 10**5000}, ["name", "an integer of 16610 bits", "string"]),
    ({"head_dim": 64, "name": b"abc"}, ["name", "string"]),
    ({"head_dim": 64, "sram_budget": True}, ["sram_budget", "True", "not a size"]),
    ({"head_dim": 64, "mask_mod": "j <= i + \u00e9", "inputs": {"\u00e9": "scalar"}}, ["inputs", "ASCII identifier"]),
])
def test_bad_python_specs_raise_one_located_line(fields, words):
    message = _one_line_spec_error(lambda: Spec(**fields))
    assert message.startswith("Spec: "), message
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


def test_python_and_file_errors_say_the_same(tmp_path):
    from_python = _one_line_spec_error(lambda: Spec(head_dim=64, dtype="fp64"))
    from_file = error_of(tmp_path, "head_dim: 64\ndtype: fp64\n")
    assert from_python.removeprefix("Spec: ") == from_file.split(": ", 1)[1]


@pytest.mark.parametrize("raw, words", [
    (b"\xff\xfehead_dim: 64\n", ["not UTF-8", "0xff", "save it as UTF-8"]),
    ("head_dim: 64\n".encode("utf-16"), ["not UTF-8"]),
    (b"head_dim: 64\nhead_dim: 128\n", ["line 2", "'head_dim' appears twice"]),
    (b"[" * 1000 + b"]" * 1000, ["nest"]),
    (b"head_dim: 64\nname: " + b"[" * 1000 + b"]" * 1000, ["nest"]),
    (b"head_dim: 64\nname: " + b"[" * 40 + b"]" * 40, ["nested more than 32 levels"]),
    (b"head_dim: 64\ninputs: [[]]\n", ["inputs", "mapping"]),
    (b"head_dim: 1" + b"0" * 5000 + b"\n", ["more than 4,300 digits"]),
    (b"head_dim: 64\nname: 0x" + b"f" * 4000 + b"\n", ["name", "an integer of 16000 bits"]),
])
def test_bad_files_raise_one_located_line(tmp_path, raw, words):
    path = tmp_path / "spec.yaml"
    path.write_bytes(raw)
    message = _one_line_spec_error(lambda: load_specs(path))
    assert message.startswith(str(path))
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"


@pytest.mark.parametrize("field", ["dtype", "head_dim", "name", "inputs", "window", "sram_budget"])
def test_a_yaml_alias_bomb_is_refused_at_once(tmp_path, field):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * 9)}]" for k in range(1, 9)]
    text = "\n".join(lines).replace("a8: &a8", f"{field}: &a8") + "\n"
    if field != "head_dim":
        text = "head_dim: 64\n" + text
    message = error_of(tmp_path, text)
    assert "more than" in message or "unknown field" in message


def test_merge_keys_may_override_but_plain_keys_may_not_repeat(tmp_path):
    specs = load_specs(write(tmp_path, "- &base {head_dim: 64, name: a}\n- {<<: *base, name: b, dtype: bf16}\n"))
    assert [(s.variant_name, s.head_dim, s.dtype) for s in specs] == [("a", 64, "fp16"), ("b", 64, "bf16")]


def test_the_duplicate_name_check_is_linear(tmp_path):
    import time

    text = "".join(f"- {{head_dim: 64, name: v{n}}}\n" for n in range(20000)) + "- {head_dim: 64, name: v7}\n"
    path = write(tmp_path, text)
    start = time.perf_counter()
    with pytest.raises(SpecError, match="variants 8 and 20001 share the name v7"):
        load_specs(path)
    assert time.perf_counter() - start < 20   # yaml and pydantic dominate: was quadratic (30 s at 40k)


def test_the_largest_window_still_builds():
    from fagen.build import prepare

    spec = Spec(head_dim=64, mask="sliding_window", window=2**31 - 1)
    assert "2147483647" in prepare(spec, None).rendered.text


def test_legitimate_expressions_of_dozens_of_terms_build_in_seconds():
    import time

    from fagen.build import prepare

    texts = [" + ".join(f"(score if i < {k} else {k})" for k in range(12)),   # was 30 s at 6 terms
             "tanh(" * 8 + "score" + ")" * 8,                                   # was 30-106 s
             " + ".join(f"score * {k}" for k in range(100))]
    for text in texts:
        start = time.perf_counter()
        prepare(Spec(head_dim=64, score_mod=text), None)
        assert time.perf_counter() - start < 10, text[:60]


# ---- fuzzing the loader: anything but SpecError is a bug -----------------------------------------
_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.integers(0, 1).map(lambda big: 10**5000 if big else -2**40000) | st.floats(allow_nan=True)
    | st.text(max_size=12) | st.sampled_from(["fp16", "bf16", "causal", "48KiB", "i < j", "score", "forward"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8)
_FIELDS = st.sampled_from(list(Spec.model_fields) + ["head_dimm", "", "variants"])


@settings(max_examples=150)
@given(fields=st.dictionaries(_FIELDS, _VALUES, max_size=6), head_dim=st.sampled_from([None, 64, 1, 256, 0]))
def test_fuzzed_spec_mappings_raise_only_spec_error(fields, head_dim):
    import time

    if head_dim is not None:
        fields = {"head_dim": head_dim, **fields}
    start = time.perf_counter()
    try:
        spec_from_dict(fields, "fuzz")
    except SpecError as err:
        assert "\n" not in str(err) and str(err).startswith("fuzz")
    assert time.perf_counter() - start < 5


_YAML_PIECES = st.sampled_from(["head_dim: ", "64", "\n", "- ", "{", "}", "[", "]", ": ", "&a ", "*a", "<<: ",
                                "dtype: ", "bf16", "mask: ", "causal", "'", '"', "#", "\t", "  ", "\xff", "\u00e9",
                                "!!python/object:os.system ", "mask_mod: ", "i < j", "window: ", "1e400", "true",
                                "1" + "0" * 4400, "0x" + "f" * 4000, "!!binary "])


@settings(max_examples=150)
@given(pieces=st.lists(_YAML_PIECES, max_size=30), junk=st.binary(max_size=8))
def test_fuzzed_spec_files_raise_only_spec_error(tmp_path_factory, pieces, junk):
    import time

    path = tmp_path_factory.mktemp("fuzz") / "spec.yaml"
    path.write_bytes("".join(pieces).encode("utf-8", "surrogateescape") + junk)
    start = time.perf_counter()
    try:
        load_specs(path)
    except SpecError as err:
        assert "\n" not in str(err) and str(err).startswith(str(path))
    assert time.perf_counter() - start < 5


_MOSTLY_VALID = st.fixed_dictionaries({"head_dim": st.one_of(*[st.integers(1, 256)] * 4, st.sampled_from([0, 257, True, "64"]))}, optional={
    "dtype": st.sampled_from(DTYPES + ("fp64",)),
    "mask": st.sampled_from(MASKS),
    "window": st.integers(-1, 2**31) | st.sampled_from([1, 7, 128, 2**31 - 1]),
    "block_size": st.sampled_from([16, 32, 64, 128, 256, 48, 512]),
    "dropout": st.sampled_from([0.0, 0.1, 0.5, MIN_DROPOUT, 0.99, 1.0, 1e-9]),
    "softmax_scale": st.sampled_from([0.125, 1.0, 1e-30, 1e30, 1e300]),
    "loop_order": st.sampled_from(LOOP_ORDERS),
    "sram_budget": st.sampled_from(["48KiB", "96KB", 16384, 1, "227KiB", 2**40]),
    "tile_policy": st.sampled_from(TILE_POLICIES),
    "arch": st.sampled_from(ARCHS),
    "passes": st.lists(st.sampled_from(["forward", "backward", "decode"]), min_size=1, max_size=3, unique=True),
    "deterministic": st.booleans(),
    "layout": st.sampled_from(LAYOUTS),
    "mask_mod": st.sampled_from(["j <= i", "doc[b, i] == doc[b, j]", "(i - j) % 3 == 0 or j < 4", "i // 64 >= j // 64"]),
    "score_mod": st.sampled_from(["cap * tanh(score / cap)", "score - slope[h] * (i - j)", "score + bias[h, i - j]",
                                  "where(i > j, score * 2, score)"]),
})


@settings(max_examples=60)
@given(fields=_MOSTLY_VALID)
def test_fuzzed_mostly_valid_specs_render_or_raise_spec_error(fields):
    """A spec that validates must solve and render: an error there would be the spec's job to have said."""
    import time

    from fagen.build import prepare

    text = f"{fields.get('mask_mod')} {fields.get('score_mod')}"
    inputs = {name: kind for name, kind in (("doc", "int32"), ("slope", "float32"), ("bias", "float32"), ("cap", "scalar"))
              if name in text}
    if inputs:
        fields = {**fields, "inputs": inputs}
    start = time.perf_counter()
    try:
        spec = spec_from_dict(fields, "fuzz")
        prepare(spec, None)
    except SpecError as err:
        assert "\n" not in str(err)
    assert time.perf_counter() - start < 20


@pytest.mark.parametrize("fields", [{"head_dim": 0}, {"head_dim": 10**9}, {"head_dim": 64, "dropout": 5},
                                    {"head_dim": 64, "mask": "sliding_window", "window": -3},
                                    {"head_dim": 64, "softmax_scale": 0}, {"head_dim": 64, "block_size": 48}])
def test_the_json_schema_has_the_specs_ranges(fields):
    with pytest.raises(_jsonschema().ValidationError):
        _jsonschema().validate(fields, json_schema())
    with pytest.raises(SpecError):
        Spec(**fields)


# ---- value_head_dim ---------------------------------------------------------------------------
def test_value_head_dim_names_the_spec_and_defaults_to_head_dim():
    mla = Spec(head_dim=192, value_head_dim=128, dtype="bf16")
    assert (mla.value_dim, mla.compute_dim) == (128, 192)
    # each call tensor's last dim: q, k and their gradients at head_dim, the rest at the values'
    assert {name: mla.tensor_dim(name) for name in ("q", "k", "dq", "dk", "v", "o", "d_o", "dv")} == {
        "q": 192, "k": 192, "dq": 192, "dk": 192, "v": 128, "o": 128, "d_o": 128, "dv": 128}
    assert mla.canonical_name.startswith("d192v128_bf16")
    assert json.loads(mla.canonical_json())["value_head_dim"] == 128
    plain = Spec(head_dim=64)
    assert (plain.value_dim, plain.compute_dim) == (64, 64) and "value_head_dim" not in plain.to_dict()
    # the same d written out is the same spec (the same name, cache key and kernels)
    assert Spec(head_dim=64, value_head_dim=64).canonical_json() == plain.canonical_json()
    assert Spec(head_dim=64, value_head_dim=128).compute_dim == 128


@pytest.mark.parametrize("fields, message", [
    (dict(head_dim=60, value_head_dim=64), "multiples of 8 for both"),
    (dict(head_dim=64, value_head_dim=100), "multiples of 8 for both"),
    (dict(head_dim=64, value_head_dim=300), "value_head_dim must be from 8 to 256"),
    (dict(head_dim=64, value_head_dim=0), "value_head_dim must be from 8 to 256"),
    (dict(head_dim=64, value_head_dim="128"), "value_head_dim"),
    (dict(head_dim=64, value_head_dim=128, dtype="fp32"), "tensor-core templates: dtype fp16 or bf16"),
    (dict(head_dim=64, value_head_dim=128, loop_order="fa1"), "loop_order fa2"),
    (dict(head_dim=64, value_head_dim=128, tile_policy="paper"), "tile_policy auto"),
    (dict(head_dim=64, value_head_dim=128, deterministic=True), "not deterministic"),
])
def test_value_head_dim_refusals_say_what_is_allowed(fields, message):
    with pytest.raises(SpecError, match=message):
        Spec(**fields)


def test_value_head_dim_loads_from_yaml(tmp_path):
    path = tmp_path / "mla.yaml"
    path.write_text("head_dim: 192\nvalue_head_dim: 128\ndtype: bf16\nmask: causal\n")
    (spec,) = load_specs(path)
    assert spec.value_dim == 128 and spec.head_dim == 192


# ---- fp8_e4m3 ---------------------------------------------------------------------------------
def test_fp8_builds_the_forward_alone_by_default_and_names_itself():
    spec = Spec(head_dim=128, dtype="fp8_e4m3", mask="causal")
    assert spec.passes == ("forward",) and spec.fp8 and spec.output_dtype == "bf16" and spec.element_bytes == 1
    assert "fp8e4m3" in spec.canonical_name
    assert Spec(**spec.to_dict()) == spec   # (a spec file of it reads back the same)
    assert Spec(head_dim=128, dtype="bf16").output_dtype == "bf16" and not Spec(head_dim=128, dtype="bf16").fp8


@pytest.mark.parametrize("fields, message", [
    ({"passes": ["forward", "backward"]}, "passes .* are not built yet: the fp8 forward alone"),
    ({"passes": ["forward", "decode"]}, "passes .* are not built yet"),
    ({"arch": "sm_80"}, "FP8 wgmma: arch sm_90, not sm_80"),
    ({"head_dim": 96}, "head_dim 64, 128, 192 or 256"),
    ({"head_dim": 32}, "head_dim 64, 128, 192 or 256"),
    ({"value_head_dim": 64}, "value_head_dim must equal head_dim"),
    ({"loop_order": "fa1"}, "loop_order fa2, tile_policy auto"),
    ({"tile_policy": "paper"}, "loop_order fa2, tile_policy auto"),
    ({"mask": "block_sparse", "block_size": 32}, "block_size 64, 128 or 256"),
])
def test_fp8_refuses_what_its_forward_does_not_take(fields, message):
    with pytest.raises(SpecError, match=message):
        Spec(**{"head_dim": 128, "dtype": "fp8_e4m3", **fields})


# ---- latent_kv: MLA decoding's shared cache ----------------------------------------------------------------------
def test_a_latent_spec_decodes_alone_and_names_itself():
    spec = Spec(head_dim=576, value_head_dim=512, latent_kv=True, dtype="bf16", mask="padding")
    assert spec.passes == ("decode",) and spec.value_dim == 512 and spec.compute_dim == 576
    assert "latent" in spec.canonical_name
    assert spec.canonical_name != Spec(head_dim=160, value_head_dim=128, latent_kv=True, dtype="bf16").canonical_name
    # a spec without latent_kv keeps the JSON (and the cache key) it had before the field existed
    assert "latent_kv" not in Spec(head_dim=64).to_dict() and spec.to_dict()["latent_kv"] is True


@pytest.mark.parametrize("fields, message", [
    (dict(head_dim=576, value_head_dim=512), "head_dim must be from 1 to 256 .up to 576 only with latent_kv"),
    (dict(head_dim=128, value_head_dim=384), "value_head_dim must be from 8 to 256 .up to 512 only with latent_kv"),
    (dict(head_dim=576, latent_kv=True), "value_head_dim must be set and below head_dim"),
    (dict(head_dim=512, value_head_dim=576, latent_kv=True), "value_head_dim must be"),
    (dict(head_dim=200, value_head_dim=128, latent_kv=True), "head_dim a multiple of 32"),
    (dict(head_dim=576, value_head_dim=448, latent_kv=True), "value_head_dim of 128"),
    (dict(head_dim=576, value_head_dim=512, latent_kv=True, passes=["forward", "decode"]), "passes \\[decode\\]"),
    (dict(head_dim=576, value_head_dim=512, latent_kv=True, dtype="fp32"), "fp16 or bf16"),
    (dict(head_dim=576, value_head_dim=512, latent_kv=True, dropout=0.1), "dropout 0"),
    (dict(head_dim=576, value_head_dim=512, latent_kv=True, mask="block_sparse", block_size=64), "decode pass takes"),
    (dict(head_dim=576, value_head_dim=512, latent_kv=True, mask_mod="j <= i"), "does not take mask_mod"),
])
def test_latent_refusals_say_what_is_allowed(fields, message):
    with pytest.raises(SpecError, match=message):
        Spec(**fields)


def test_the_schema_bounds_head_dims_as_the_validators_do():
    """The JSON Schema takes head dims above 256 only with latent_kv, as Spec does."""
    jsonschema = pytest.importorskip("jsonschema")
    validator = jsonschema.Draft202012Validator(json_schema())
    for fields in (dict(head_dim=300), dict(head_dim=64, value_head_dim=384),
                   dict(head_dim=576, value_head_dim=512, latent_kv=False),
                   dict(head_dim=576, value_head_dim=512, latent_kv=True), dict(head_dim=256, value_head_dim=128)):
        try:
            Spec(**fields)
            accepted = True
        except SpecError:
            accepted = False
        assert validator.is_valid(fields) == accepted, fields
