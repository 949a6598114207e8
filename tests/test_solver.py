"""The tile solver: every plan it returns keeps every constraint, nothing feasible ranks better, the paper's
closed form, infeasible specs, the traffic model and the JSON report.
Properties over random specs (hypothesis; the `ci` profile is derandomized). A failure prints the spec's
fields, which `Spec(**fields)` replays. Everything here is CPU-only and needs no nvcc.
"""
from __future__ import annotations

import itertools
import json
import math
import re

import pytest
import sympy as sp
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from fagen import solver
from fagen.solver import (FAMILIES, Bc, Br, InfeasibleSpec, Plan, W, d, evaluate, families_for, family_named,
                          family_plans, solve)
from fagen.spec import ARCHS, DTYPES, DTYPES_EVERY_PASS, LOOP_ORDERS, MASKS, MIN_DROPOUT, PASSES, Spec
from fagen.target import TARGETS, target_for

REGISTER_CEILING = 255

# ---- strategies -----------------------------------------------------------------------------
budgets = st.one_of(
    st.none(),                                                   # the target's per-block limit
    st.integers(1024, 300_000),                                  # bytes, from hopeless to above any limit
    st.integers(1, 300).map(lambda k: f"{k}KiB"),
    st.sampled_from(["48KiB", "64 KiB", "96KB", "100KiB", "163KiB", "227KiB", "0.25MiB"]),
)


@st.composite
def spec_fields(draw, policy=None, passes=None, mask=None) -> dict:
    """The fields of a valid spec; every field the solver reads varies."""
    fields = {
        "head_dim": draw(st.sampled_from(range(32, 257, 8))),
        "dtype": draw(st.sampled_from(DTYPES_EVERY_PASS)),
        "mask": mask or draw(st.sampled_from(MASKS)),
        "loop_order": draw(st.sampled_from(LOOP_ORDERS)),
        "dropout": draw(st.one_of(st.just(0.0), st.floats(MIN_DROPOUT, 0.9))),
        "sram_budget": draw(budgets),
        "tile_policy": policy or draw(st.sampled_from(("paper", "auto"))),
        "arch": draw(st.sampled_from(ARCHS)),
        "passes": passes or draw(st.sampled_from([PASSES, ("forward",), ("backward",)])),
    }
    if fields["mask"] == "sliding_window":
        fields["window"] = draw(st.integers(1, 4096))
    if fields["mask"] == "block_sparse":
        fields["block_size"] = draw(st.sampled_from([16, 32, 64, 128, 256]))
    if "backward" in fields["passes"]:
        fields["deterministic"] = draw(st.booleans())
    return fields


def solve_or_none(spec: Spec, **kwargs):
    try:
        return solve(spec, **kwargs)
    except InfeasibleSpec:
        return None


# ---- independent re-computations ------------------------------------------------------------
def effective_budget(spec: Spec) -> int:
    """What `auto` must fit in: the spec's sram_budget, never above what the target lets a block have."""
    limit = target_for(spec.arch).smem_per_block
    return min(spec.sram_budget, limit) if spec.sram_budget is not None else limit


def paper_m(spec: Spec) -> int:
    """M of the paper's constraint, in elements: the spec's budget (or the target's limit) // element bytes.
    (The solver takes the spec's sram_budget as given here even above the target's limit; see the report.)"""
    nbytes = spec.sram_budget if spec.sram_budget is not None else target_for(spec.arch).smem_per_block
    return nbytes // spec.element_bytes


def family_named(name: str) -> solver.Family:
    (family,) = [f for f in solver.FAMILIES if f.name == name]
    return family


def substitutions(spec: Spec, plan: Plan) -> dict:
    """The footprint's symbols at this plan; d is the head dim the template computes with (padded)."""
    return {Br: plan.block_r, Bc: plan.block_c, d: plan.head_dim, W: plan.warps, solver.E: spec.element_bytes}


def feasible_plans(spec: Spec, pass_name: str) -> list[Plan]:
    """Every auto plan of the first tier (tensor-core families, then CUDA-core ones) able to realise the
    pass, found by enumerating each family's tile choices through `solver.evaluate` and applying the
    budget here: at each family's least padded head dim, then at its next multiples, as long as nothing
    in the tier fits."""
    target, budget = target_for(spec.arch), effective_budget(spec)
    families = solver.families_for(spec, pass_name)
    for tier in (True, False):
        members = [f for f in families if f.tensor_cores == tier]
        for step in range(max((len(solver.padded_head_dims(f, spec.head_dim)) for f in members), default=0)):
            feasible = []
            for family in members:
                dims = solver.padded_head_dims(family, spec.head_dim)
                if step >= len(dims):
                    continue
                for warps, (block_r, block_c) in itertools.product(family.warps, solver.family_tiles(family)):
                    plan, broken = solver.evaluate(family, spec, target, pass_name, block_r, block_c, warps, dims[step])
                    if not broken and plan.smem_bytes <= budget:
                        feasible.append(plan)
            if feasible:
                return feasible
    return []


def reserved_registers(family, values: dict, spec: Spec):
    """The family's register reservations a spec takes (Philox state, a packed batch's offsets, a mask_mod /
    score_mod's state: for a mask_mod alone, the light one of a few integer operations or the one of a mask_mod
    that reads inputs at key positions, where the family has them), each an int or an expression of the tile, at
    these tile values."""
    modifiers = spec.modifiers
    alone = modifiers.mask_mod_alone
    light = alone and modifiers.light_mask_mod and family.light_mask_mod_registers is not None
    keys = alone and modifiers.mask_reads_keys and family.key_mask_mod_registers is not None
    return sum(sp.sympify(term).subs(values) for term, holds in
               ((family.dropout_registers, spec.dropout > 0), (family.packed_registers, spec.layout == "packed"),
                (family.modifier_registers, modifiers.active and not light and not keys),
                (family.light_mask_mod_registers, light), (family.key_mask_mod_registers, keys)) if holds)


def check_plan_constraints(spec: Spec, solution: solver.Solution, pass_name: str, plan: Plan) -> None:
    family = family_named(plan.family)
    target = target_for(spec.arch)
    values = substitutions(spec, plan)
    assert plan.template == family.template
    assert pass_name in family.passes and spec.loop_order in family.loop_orders and spec.dtype in family.dtypes
    assert plan.warps in family.warps and plan.threads == 32 * plan.warps
    # Shared memory: the family's own sympy footprint at this plan, within the budget or the hardware.
    assert plan.smem_bytes == int(family.smem_bytes.subs(values)), "smem_bytes is the family's footprint"
    limit = target.smem_per_block if solution.policy == "paper" else effective_budget(spec)
    assert plan.smem_bytes <= limit, f"{plan.smem_bytes} B of shared memory > {limit} B ({solution.policy})"
    assert plan.smem_bytes <= target.smem_per_block
    # Registers: the family's estimate (plus its Philox state under dropout, the sequence offsets of a packed batch,
    # a mask_mod / score_mod's state), under the per-thread ceiling.
    reserved = reserved_registers(family, values, spec)
    assert plan.registers_estimate == int(sp.ceiling(family.registers.subs(values) + reserved))
    assert plan.registers_estimate <= REGISTER_CEILING
    # The family's own tile rules: MMA row slabs per warp, the range of Bc, tensor-core multiples.
    if family.m_tiles:
        assert plan.block_r in [16 * plan.warps * m for m in family.m_tiles]
    assert family.min_block_c <= plan.block_c <= family.max_block_c
    if not family.any_tile:
        assert plan.block_r % 16 == 0 and plan.block_c % 16 == 0
    # the computed head dim: the spec's, or (tensor cores, d a multiple of 8) the next multiple of the family's
    assert plan.head_dim % family.head_dim_multiple == 0 and spec.head_dim <= plan.head_dim <= 256
    # (a further multiple where the family weighs padding: d = 129-160 as 192 on backward_wgmma_wide)
    assert plan.head_dim == spec.head_dim or (family.tensor_cores
                                              and plan.head_dim in solver.padded_head_dims(family, spec.head_dim))
    assert plan.smem_reads == int(sp.ceiling(family.smem_reads.subs(values)))
    if spec.mask == "block_sparse":
        assert spec.block_size % plan.block_r == 0 and spec.block_size % plan.block_c == 0, \
            f"Br={plan.block_r}, Bc={plan.block_c} must divide block_size {spec.block_size}"
    if solution.policy == "auto":
        assert (plan.block_r, plan.block_c) in solver.family_tiles(family)
    assert plan.hbm_bytes == solver.hbm_bytes(spec, pass_name, plan.block_r, plan.block_c)
    assert plan.resident_warps >= plan.warps, "at least one block fits on a multiprocessor"


def check_paper_report(spec: Spec, report: dict) -> None:
    m_elements = paper_m(spec)
    r, c, hd = report["block_r"], report["block_c"], spec.head_dim
    assert (c, r) == (math.ceil(m_elements / (4 * hd)), min(math.ceil(m_elements / (4 * hd)), hd))
    lhs = r * hd + 2 * c * hd + 2 * r * c
    assert (report["lhs"], report["rhs"], report["holds"]) == (lhs, m_elements, lhs <= m_elements)
    assert type(report["holds"]) is bool and type(report["lhs"]) is int and type(report["rhs"]) is int


# ---- every returned plan keeps every constraint -----------------------------------------------
@given(spec_fields())
def test_every_plan_satisfies_every_constraint(fields):
    spec = Spec(**fields)
    solution = solve_or_none(spec)
    if solution is None:
        if spec.tile_policy == "auto":
            assert any(not feasible_plans(spec, p) for p in spec.passes), \
                "InfeasibleSpec although every pass has a feasible plan"
        return
    assert solution.policy == spec.tile_policy and solution.target == target_for(spec.arch)
    assert solution.budget_bytes == effective_budget(spec)
    assert set(solution.plans) == set(spec.passes) == set(solution.candidates)
    for pass_name, plan in solution.plans.items():
        assert solution.candidates[pass_name][0] == plan, "the plan is the best-ranked candidate"
        for candidate in solution.candidates[pass_name]:
            check_plan_constraints(spec, solution, pass_name, candidate)
    check_paper_report(spec, solution.paper)


@given(spec_fields(policy="auto"))
def test_no_feasible_plan_ranks_better(fields):
    spec = Spec(**fields)
    solution = solve_or_none(spec)
    assume(solution is not None)
    for pass_name, plan in solution.plans.items():
        feasible = feasible_plans(spec, pass_name)
        assert plan in feasible
        def rank(p):
            return p.rank_key(spec.head_dim)
        best = min(feasible, key=rank)
        assert rank(plan) == rank(best), f"{best} ranks better than the chosen {plan}"
        # The candidates are exactly the feasible plans, ranked.
        ranked = solution.candidates[pass_name]
        assert sorted(ranked, key=rank) == list(ranked)
        assert set(ranked) == set(feasible)


@given(spec_fields(mask="block_sparse"))
def test_block_sparse_tiles_divide_the_granularity(fields):
    spec = Spec(**fields)
    solution = solve_or_none(spec)
    assume(solution is not None)
    for plan in (p for ranked in solution.candidates.values() for p in ranked):
        assert spec.block_size % plan.block_r == 0 and spec.block_size % plan.block_c == 0


# ---- the compiled footprints -------------------------------------------------------------------
MODIFIER_FIELDS = ({}, {"score_mod": "score * 0.5"}, {"mask_mod": "j < prefix[b] or j <= i", "inputs": {"prefix": "int32"}},
                   {"mask_mod": "doc[b, i] == doc[b, j]", "inputs": {"doc": "int32"}})


@settings(max_examples=200)
@given(st.sampled_from(solver.FAMILIES), st.integers(1, 512), st.integers(1, 1024), st.sampled_from(range(32, 257, 8)),
       st.sampled_from(DTYPES_EVERY_PASS), st.booleans(), st.booleans(), st.sampled_from(MODIFIER_FIELDS), st.data())
def test_compiled_footprints_equal_sympys_exact_values(family, block_r, block_c, head_dim, dtype, dropout, packed,
                                                       modifiers, data):
    """Candidates are evaluated by functions lambdified once per family, in floats; they must give exactly
    what substituting into the sympy expressions gives, odd tiles (the paper policy's) included, with each
    reservation (dropout, packed batches, a score_mod, a mask_mod with or without loads per position) that may
    itself be an expression of the tile."""
    warps = data.draw(st.sampled_from(family.warps))
    spec = Spec(head_dim=head_dim, dtype=dtype, dropout=0.1 if dropout else 0.0, layout="packed" if packed else "padded",
                **modifiers)
    plan, _ = solver.evaluate(family, spec, target_for("sm_90"), family.passes[0], block_r, block_c, warps)
    values = {Br: block_r, Bc: block_c, d: plan.head_dim, W: warps, solver.E: spec.element_bytes,   # padded d
              solver.Dv: plan.head_dim}
    assert plan.head_dim == (solver.padded_head_dim(family, head_dim) or head_dim)
    reserved = reserved_registers(family, values, spec)
    assert plan.smem_bytes == int(family.smem_bytes.subs(values))
    assert plan.registers_estimate == int(sp.ceiling(family.registers.subs(values) + reserved))
    assert plan.smem_reads == int(sp.ceiling(family.smem_reads.subs(values)))


def test_a_solve_substitutes_nothing_into_sympy(monkeypatch):
    """Once a family's functions are compiled, solving a new spec (feasible or not) is plain arithmetic:
    no sympy substitution or lambdify on that path (it made a solve cost ~0.5 s)."""
    for spec in (Spec(head_dim=64, dtype=dtype, loop_order=order, dropout=0.1, tile_policy=policy)
                 for dtype in DTYPES_EVERY_PASS for order in LOOP_ORDERS for policy in ("auto", "paper")):
        solve_or_none(spec)  # compiles every family once

    def forbidden(*args, **kwargs):
        raise AssertionError("sympy called while solving")

    for name in ("subs", "xreplace"):
        monkeypatch.setattr(sp.Basic, name, forbidden)
    monkeypatch.setattr(sp, "lambdify", forbidden)
    for fields in ({"head_dim": 136, "dtype": "bf16", "mask": "causal", "dropout": 0.2},
                   {"head_dim": 200, "dtype": "fp32", "loop_order": "fa1", "tile_policy": "paper"},
                   {"head_dim": 96, "sram_budget": 2048}):
        solve_or_none(Spec(**fields))


# ---- the paper's closed form --------------------------------------------------------------------
@given(spec_fields(policy="paper"))
def test_paper_policy_is_the_closed_form(fields):
    spec = Spec(**fields)
    m_elements = paper_m(spec)
    block_c = math.ceil(m_elements / (4 * spec.head_dim))
    block_r = min(block_c, spec.head_dim)
    try:
        solution = solve(spec)
    except InfeasibleSpec as err:
        # The paper's tiles may not fit the template on this hardware: the error says which tiles and why.
        assert f"Br={block_r}, Bc={block_c}" in str(err)
        return
    for plan in solution.plans.values():
        assert (plan.block_r, plan.block_c) == (block_r, block_c)
    report = solution.paper
    assert (report["block_r"], report["block_c"]) == (block_r, block_c)
    lhs = block_r * spec.head_dim + 2 * block_c * spec.head_dim + 2 * block_r * block_c
    assert (report["lhs"], report["rhs"], report["holds"]) == (lhs, m_elements, lhs <= m_elements)


def test_paper_tiles_above_128_columns_fit_the_simt_template():
    spec = Spec(head_dim=64, dtype="fp16", loop_order="fa1", tile_policy="paper", sram_budget="100KiB",
                passes=["forward"])
    plan = solve(spec).primary
    assert (plan.block_r, plan.block_c) == (64, 200) and plan.smem_bytes <= target_for("sm_90").smem_per_block


def test_paper_constraint_is_a_sympy_relational():
    assert isinstance(solver.PAPER_CONSTRAINT, sp.Le)
    assert sp.simplify(solver.PAPER_CONSTRAINT.lhs - (Br * d + 2 * Bc * d + 2 * Br * Bc)) == 0
    assert solver.PAPER_CONSTRAINT.rhs == solver.M


def test_paper_tiles_for_48kib_fp16_d64():
    # M = 49152 / 2 = 24576 elements: Bc = ceil(24576 / 256) = 96, Br = min(96, 64) = 64, and
    # 64*64 + 2*96*64 + 2*64*96 = 28672 > 24576: the closed form itself overshoots M here.
    spec = Spec(head_dim=64, dtype="fp16", loop_order="fa1", tile_policy="paper", sram_budget="48KiB",
                passes=["forward"])
    solution = solve(spec)
    assert (solution.primary.block_r, solution.primary.block_c) == (64, 96)
    assert {k: solution.paper[k] for k in ("lhs", "rhs", "holds")} == {"lhs": 28672, "rhs": 24576, "holds": False}


# ---- infeasible specs -----------------------------------------------------------------------------
def smallest_budget(message: str) -> int:
    found = re.search(r"smallest budget that works(?: for every pass)? is (\d+) bytes", message)
    assert found, f"the message names no smallest budget: {message}"
    return int(found.group(1))


@given(spec_fields(policy="auto"), st.integers(1, 4096))
def test_infeasible_budget_names_the_constraint_and_the_smallest_budget(fields, budget):
    spec = Spec(**{**fields, "sram_budget": budget})
    with pytest.raises(InfeasibleSpec) as info:
        solve(spec)
    message = str(info.value)
    assert "\n" not in message and spec.variant_name in message
    assert "shared memory" in message and f"sram_budget {budget} bytes" in message
    need = smallest_budget(message)
    assert need > budget
    # ... and that budget is the smallest that works (for every pass): one byte less still fails.
    solution = solve(spec.model_copy(update={"sram_budget": need}))
    assert max(plan.smem_bytes for plan in solution.plans.values()) <= need
    with pytest.raises(InfeasibleSpec):
        solve(spec.model_copy(update={"sram_budget": need - 1}))


def test_one_kib_is_infeasible():
    spec = Spec(head_dim=64, passes=["forward"], sram_budget="1KiB")
    with pytest.raises(InfeasibleSpec, match=r"sram_budget 1024 bytes is too small .* shared memory") as info:
        solve(spec)
    assert solve(spec.model_copy(update={"sram_budget": smallest_budget(str(info.value))})).plans


def test_smallest_budget_covers_every_pass():
    spec = Spec(head_dim=64, sram_budget="1KiB")  # forward and backward
    with pytest.raises(InfeasibleSpec) as info:
        solve(spec)
    solve(spec.model_copy(update={"sram_budget": smallest_budget(str(info.value))}))


def test_infeasible_message_states_the_familys_own_footprint():
    spec = Spec(head_dim=64, sram_budget="1KiB")  # forward and backward
    with pytest.raises(InfeasibleSpec) as info:
        solve(spec)
    found = re.search(r"(\w+) needs shared memory (\d+) bytes at its smallest tiles \(Br=(\d+), Bc=(\d+)\)",
                      str(info.value))
    assert found, str(info.value)
    family, nbytes, block_r, block_c = found.group(1), *map(int, found.groups()[1:])
    footprint = family_named(family).smem_bytes.subs({Br: block_r, Bc: block_c, d: 64, solver.E: 2})
    assert nbytes == int(footprint)


def test_infeasible_is_a_spec_error():
    from fagen.spec import SpecError

    assert issubclass(InfeasibleSpec, SpecError)


# ---- the traffic model ----------------------------------------------------------------------------
@given(spec_fields(), st.lists(st.integers(1, 512), min_size=2, max_size=6, unique=True),
       st.integers(1, 512), st.integers(1, 1 << 16))
def test_fa2_forward_traffic_never_grows_with_br(fields, rows, block_c, n):
    spec = Spec(**{**fields, "loop_order": "fa2"})
    traffic = [solver.hbm_bytes(spec, "forward", r, block_c, n) for r in sorted(rows)]
    assert all(a >= b for a, b in zip(traffic, traffic[1:])), list(zip(sorted(rows), traffic))


@given(spec_fields(), st.integers(1, 512), st.integers(1, 512))
def test_fa1_and_backward_traffic_never_grow_with_bc(fields, block_r, block_c):
    spec = Spec(**fields)
    for pass_name in ("forward", "backward"):
        if pass_name == "forward" and spec.loop_order == "fa2":
            continue
        assert solver.hbm_bytes(spec, pass_name, block_r, block_c + 1) <= solver.hbm_bytes(spec, pass_name, block_r, block_c)


# ---- the report -------------------------------------------------------------------------------------
@given(spec_fields())
def test_solution_to_dict_is_json(fields):
    spec = Spec(**fields)
    solution = solve_or_none(spec)
    assume(solution is not None)
    data = json.loads(json.dumps(solution.to_dict()))
    primary = solution.primary
    assert data["name"] == spec.variant_name
    assert (data["block_r"], data["block_c"], data["smem_bytes"]) == (primary.block_r, primary.block_c,
                                                                      primary.smem_bytes)
    assert {"lhs", "rhs", "holds"} <= set(data["constraint"])
    assert (data["constraint"]["lhs"], data["constraint"]["rhs"], data["constraint"]["holds"]) == \
        (solution.paper["lhs"], solution.paper["rhs"], solution.paper["holds"])
    assert isinstance(data["candidates"], list) and data["candidates"]
    assert data["candidates"][0] == primary.to_dict()
    assert set(data["passes"]) == set(spec.passes)


def test_targets_are_plain_data():
    assert set(TARGETS) == set(ARCHS)
    for arch, target in TARGETS.items():
        assert target.arch == arch and target.registers_per_thread == REGISTER_CEILING
        assert target.smem_per_block <= target.smem_per_sm


def test_architecture_facts_are_one_table_that_the_families_read():
    """ARCH_FEATURES says what each arch's instructions allow; a family that needs a feature is offered only on the
    targets that have it, the compiler builds for the table's nvcc arch, and an arch it lacks has no feature."""
    from fagen.compiler import nvcc_arch
    from fagen.target import ARCH_FEATURES, ArchFeatures, arch_features

    assert set(ARCH_FEATURES) == set(ARCHS)
    assert [nvcc_arch(a) for a in ARCHS] == [ARCH_FEATURES[a].nvcc_arch for a in ARCHS]
    assert arch_features("sm_120") == ArchFeatures("sm_120")   # (a newer GPU: its own name, no feature assumed)
    features = {name for name in vars(ArchFeatures("x")) if name != "nvcc_arch"}
    for family in FAMILIES:
        assert set(family.needs) <= features, family.name
        for arch, target in TARGETS.items():
            plans = list(family_plans(family, Spec(head_dim=64, dtype="bf16"), target, family.passes[0]))
            missing = [need for need in family.needs if not getattr(target.features, need)]
            assert all(any(b.startswith("a target with") for b in broken) == bool(missing) for _, broken in plans), \
                (family.name, arch)


@pytest.mark.parametrize("head_dim, arch, family, computed", [
    (40, "sm_90", "forward_wgmma", 64), (72, "sm_90", "forward_wgmma", 96), (120, "sm_90", "forward_wgmma_ws", 128),
    (110, "sm_90", "forward_wgmma_ws", 128), (59, "sm_90", "forward_wgmma", 64), (64, "sm_90", "forward_wgmma", 64),
    # an odd d loads element by element (rows not 4-byte aligned): the least padding, 112 on mma.sync (Q re-read
    # from shared memory: Q, O and S of two 16-row slabs per warp do not fit at Bc = 32)
    (111, "sm_90", "forward_fa2_mma_qsmem", 112),
    # twice the columns is too many: d <= 16 stays on mma.sync at 16
    (8, "sm_90", "forward_fa2_mma", 16), (3, "sm_90", "forward_fa2_mma", 16),
    # 64-byte swizzle panels: an odd number of 32-column halves runs on wgmma unpadded
    (32, "sm_90", "forward_wgmma", 32), (90, "sm_90", "forward_wgmma", 96), (160, "sm_90", "forward_wgmma", 160),
    # without wgmma, the next multiple of 16
    (40, "sm_80", "forward_fa2_mma", 48), (72, "sm_80", "forward_fa2_mma", 80), (111, "sm_80", "forward_fa2_mma_qsmem", 112)])
def test_head_dims_pad_to_the_nearest_tensor_core_template(head_dim, arch, family, computed):
    """Any d runs on tensor cores padded to the family's multiple, the least padding first, except that on
    sm_90 wgmma at up to a third more columns beats mma.sync for an even d (PREFERRED_PADDING: 72 computes as
    96 on wgmma, not as 80 on mma.sync); fp32 stays on the CUDA cores, unpadded."""
    plan = solve(Spec(head_dim=head_dim, dtype="bf16", mask="causal", passes=["forward"], arch=arch)).plans["forward"]
    assert (plan.family, plan.head_dim) == (family, computed)
    fp32 = solve(Spec(head_dim=head_dim, dtype="fp32", mask="causal", passes=["forward"])).plans["forward"]
    assert (fp32.family, fp32.head_dim) == ("forward_fa2_simt", head_dim)


@pytest.mark.parametrize("head_dim", [32, 96])
def test_head_dims_of_32_column_halves_run_on_warpgroup_mma(head_dim):
    """d = 32 and 96 take both wgmma passes on sm_90 (64-byte swizzle panels). At d = 96 the forward keeps two
    resident blocks of Br = 128, Bc = 64 (ptxas: 128 registers, no spills; timed 1.26x faster on an H100 than
    the one block of Bc = 128 a register estimate of 136 forced)."""
    solution = solve(Spec(head_dim=head_dim, dtype="bf16", mask="causal"))
    forward, backward = solution.plans["forward"], solution.plans["backward"]
    # (d = 96's backward on the warp-specialized template, timed faster there; d = 32's was not timed)
    assert (forward.family, backward.family) == ("forward_wgmma", "backward_wgmma_ws" if head_dim == 96 else "backward_wgmma")
    assert forward.head_dim == backward.head_dim == head_dim
    if head_dim == 96:
        assert (forward.block_r, forward.block_c, forward.warps, forward.resident_warps) == (128, 64, 8, 16)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_head_dim_has_a_tensor_core_backward(arch):
    """Issue 13: fp16/bf16 backward on tensor cores at every d from 1 to 256, with and without dropout (d > 128
    on the wide families, whose warps split dK, dV by dims; the CUDA-core backward took 68 s to compile
    at d = 256 and ran at 0.03x SDPA-flash): on sm_90 backward_wgmma_wide where d pads to 192 or 256 (its
    warpgroups' halves of d are whole swizzle panels, and an even d pads up to a third more columns to get there:
    d = 129-160 as 192, 193-224 as 256), backward_fa2_mma_wide at odd d = 129-160 and 193-224 (less padding).
    Where a family's least padded d fits none of its tile plans, a
    larger multiple is tried: on sm_80 d = 193-224 run as 256 (the wide template at 224 has Br = 32 only,
    whose dQ tiles do not split over 8 warps), and with dropout d = 97-112 as 128 on backward_fa2_mma."""
    for head_dim in range(1, 257):
        for dtype, mask, dropout in (("bf16", "causal", 0.0), ("fp16", "none", 0.1)):
            plan = solve(Spec(head_dim=head_dim, dtype=dtype, mask=mask, dropout=dropout, arch=arch)).plans["backward"]
            assert plan.tensor_cores, (head_dim, dtype, dropout, plan.family)
            wgmma_wide = arch == "sm_90" and head_dim > 128 and (head_dim % 2 == 0 or 160 < head_dim <= 192 or head_dim > 224)
            assert (plan.family == "backward_wgmma_wide") == wgmma_wide, (head_dim, plan.family)
            assert (plan.family == "backward_fa2_mma_wide") == (head_dim > 128 and not wgmma_wide), (head_dim, plan.family)
            padded = solver.padded_head_dim(solver.family_named(plan.family), head_dim)
            further = arch == "sm_80" and (193 <= head_dim <= 224 or (dropout and 97 <= head_dim <= 112))
            assert (plan.head_dim > padded) == further, (head_dim, dropout, plan.head_dim)


def test_more_padding_only_where_less_fits_no_plan():
    """The least padded d wins whenever it has a plan: the larger multiples are tried only after it fits none."""
    plan = solve(Spec(head_dim=200, dtype="bf16", mask="causal", arch="sm_90")).plans["backward"]
    assert (plan.family, plan.head_dim) == ("backward_wgmma_wide", 256)   # weighed against mma.sync's 224 (PREFERRED_PADDING)
    plan = solve(Spec(head_dim=201, dtype="bf16", mask="causal", arch="sm_90")).plans["backward"]
    assert (plan.family, plan.head_dim) == ("backward_fa2_mma_wide", 224)   # an odd d: the least padding
    plan = solve(Spec(head_dim=200, dtype="bf16", mask="causal", arch="sm_80")).plans["backward"]
    assert (plan.family, plan.head_dim, plan.block_r) == ("backward_fa2_mma_wide", 256, 32)
    wide = solver.family_named("backward_fa2_mma_wide")
    assert solver.padded_head_dims(wide, 200) == [224, 256] and solver.padded_head_dims(wide, 256) == [256]
    assert solver.padded_head_dims(solver.family_named("backward_simt"), 200) == [200]


@pytest.mark.parametrize("head_dim, keys_per_warp", [(160, 16), (192, 32), (256, 32)])
def test_wide_backward_plans_at_large_head_dims(head_dim, keys_per_warp):
    """Br x Bc = 64 x 64 over 8 warps on sm_80 (Br = 32 where its blocks have too little shared memory; sm_90 runs
    these d on backward_wgmma_wide);
    the template's dK, dV take 32 keys per warp where d / (W / (Bc / 32)) is a multiple of 16, else 16."""
    for arch, block_r in (("sm_90", 64), ("sm_80", 64 if head_dim == 160 else 32)):
        if arch == "sm_90":   # backward_wgmma_wide takes those (its own test below)
            continue
        plan = solve(Spec(head_dim=head_dim, dtype="bf16", mask="causal", arch=arch)).plans["backward"]
        assert (plan.family, plan.block_r, plan.block_c, plan.warps) == ("backward_fa2_mma_wide", block_r, 64, 8)
        assert plan.smem_bytes <= target_for(arch).smem_per_block
        kv_m = 2 if (plan.head_dim // (plan.warps // (plan.block_c // 32))) % 16 == 0 else 1
        assert 16 * kv_m == keys_per_warp


@pytest.mark.parametrize("head_dim, panel_bytes", [(192, 64), (176, 64), (160, 64), (256, 128), (255, 128), (224, 128)])
def test_warpgroup_wide_backward_at_head_dims_of_whole_panels(head_dim, panel_bytes):
    """sm_90, d > 160: backward_wgmma_wide, Br x Bc = 64 x 64 over two warpgroups, each taking d/2 dims of dK, dV,
    dQ that start on a swizzle panel (d = 192: halves of 96 in 64-byte panels); within the block's shared memory and
    the register file by the family's own estimate, with dropout and a score_mod too."""
    for extra in ({}, {"dropout": 0.1}, {"score_mod": "score - slope[h] * (i - j)", "inputs": {"slope": "float32"}}):
        plan = solve(Spec(head_dim=head_dim, dtype="bf16", mask="causal", arch="sm_90", **extra)).plans["backward"]
        assert (plan.family, plan.block_r, plan.block_c, plan.warps) == ("backward_wgmma_wide", 64, 64, 8)
        assert plan.head_dim % 64 == 0 and plan.head_dim >= head_dim
        assert plan.smem_bytes <= target_for("sm_90").smem_per_block and plan.registers_estimate <= 255
        group_dims = plan.head_dim // 2
        assert group_dims % (panel_bytes // 2) == 0 and (panel_bytes == 128) == (group_dims % 64 == 0)


def test_the_warp_specialized_forward_takes_d_128():
    """forward_wgmma_ws where it was timed faster (d = 128 on sm_90, any mask kind, dropout, packed, a
    score_mod, a mask_mod reading nothing at key positions: its producer walks the tiles and hands the walk over);
    other head dims and sm_80 keep their families. A mask_mod reading inputs at key positions (documents) takes
    forward_wgmma's 64 x 64 at two blocks, timed faster there."""
    target = target_for("sm_90")
    for extra in ({}, {"mask": "causal", "dropout": 0.1}, {"layout": "packed"}, {"mask": "sliding_window", "window": 300},
                  {"score_mod": "30 * tanh(score / 30)"}, {"head_dim": 100}, {"mask": "causal", "mask_mod": "i >= j - 64"},
                  {"mask_mod": "j < prefix[b] or j <= i", "inputs": {"prefix": "int32"}, "layout": "packed"}):
        plan = solve(Spec(**{"head_dim": 128, "dtype": "bf16", **extra}), target).plans["forward"]
        assert (plan.family, plan.block_r, plan.block_c, plan.warps, plan.head_dim) == ("forward_wgmma_ws", 128, 128, 12, 128)
        assert plan.resident_warps == 12   # one block: all 64 K registers, split by setmaxnreg
    documents = {"mask": "causal", "mask_mod": "doc[b, i] == doc[b, j]", "inputs": {"doc": "int32"}}
    for extra in ({}, {"dropout": 0.1}, {"layout": "packed"}, {"head_dim": 112}, {"mask": "sliding_window", "window": 512}):
        plan = solve(Spec(**{"head_dim": 128, "dtype": "bf16", **documents, **extra}), target).plans["forward"]
        assert (plan.family, plan.block_r, plan.block_c, plan.warps, plan.head_dim) == ("forward_wgmma", 64, 64, 4, 128)
        assert plan.resident_warps == 8   # two blocks of one warpgroup
    _, broken = evaluate(family_named("forward_wgmma_ws"), Spec(head_dim=128, dtype="bf16", **documents), target,
                         "forward", 128, 128, 12)
    assert broken and all("key positions" in b for b in broken)
    plan, broken = evaluate(family_named("forward_wgmma_ws"), Spec(head_dim=64, dtype="bf16", mask_mod="i >= j"), target,
                            "forward", 128, 128, 12)
    assert broken and all("d = 128" in b for b in broken)
    for head_dim in (32, 64, 96, 160, 192, 256):
        assert solve(Spec(head_dim=head_dim, dtype="bf16"), target).plans["forward"].family == "forward_wgmma"
    assert solve(Spec(head_dim=128, dtype="bf16", arch="sm_80"), target_for("sm_80")).plans["forward"].family != "forward_wgmma_ws"


def test_d64_forward_takes_the_timed_64_row_plan_at_the_residency_its_registers_allow():
    """forward_wgmma's timed_first: at d = 64 (and what pads to 64) one warpgroup per 64-row block, 64 x 128, ranks
    ahead of the cost model's 128 x 64 (which counts K/V traffic first), over mask kinds, dropout, packed batches
    and mask_mod / score_mod specs; the resident blocks stay the register estimate's (three without modifiers and
    with a light mask_mod alone, or one that reads its inputs at key positions (documents), unless packed; two with
    any other mask_mod or a score_mod). Other head dims keep the cost model's order."""
    target = target_for("sm_90")
    for extra, resident in (({}, 12), ({"mask": "causal"}, 12), ({"mask": "causal", "dropout": 0.1}, 12),
                            ({"mask": "sliding_window", "window": 1024}, 12), ({"layout": "packed"}, 12),
                            ({"mask": "causal", "layout": "packed", "dropout": 0.1}, 8),
                            ({"mask": "causal", "mask_mod": "doc[b, i] == doc[b, j]", "inputs": {"doc": "int32"}}, 12),
                            ({"mask": "causal", "mask_mod": "doc[b, i] == doc[b, j]", "inputs": {"doc": "int32"},
                              "layout": "packed"}, 8),
                            ({"mask_mod": "j <= i + shift[b, i]", "inputs": {"shift": "int32"}}, 8),
                            ({"mask_mod": "j < prefix[b] or j <= i", "inputs": {"prefix": "int32"}}, 12),
                            ({"mask": "causal", "mask_mod": "j <= i and (i - j < 256 or j < 4)", "dropout": 0.1}, 12),
                            ({"mask": "causal", "score_mod": "score + slope[h] * (j - i)", "inputs": {"slope": "float32"}}, 8),
                            ({"head_dim": 48}, 12)):
        spec = Spec(**{"head_dim": 64, "dtype": "bf16", **extra})
        solution = solve(spec, target)
        plan = solution.plans["forward"]
        assert (plan.family, plan.block_r, plan.block_c, plan.warps, plan.head_dim) == ("forward_wgmma", 64, 128, 4, 64), extra
        assert plan.resident_warps == resident, extra
        # what it displaced: the cost model's own first choice, still a candidate right behind it
        runner_up = solution.candidates["forward"][1]
        assert (runner_up.block_r, runner_up.block_c) == (128, 64) and runner_up.hbm_bytes < plan.hbm_bytes, extra
    assert solve(Spec(head_dim=64, dtype="bf16", mask="causal"), target).plans["backward"].block_r == 128
    for head_dim in (32, 96):
        plan = solve(Spec(head_dim=head_dim, dtype="bf16", mask="causal"), target).plans["forward"]
        assert (plan.block_r, plan.block_c) == (128, 64), head_dim


def test_run_time_summaries_take_the_warp_specialized_backward_where_it_compiled_without_spills():
    """A mask_mod whose tiles are decided from its inputs' run-time summaries (document ids) runs backward_wgmma_ws
    at d = 64 and 128 on padded batches, where the producer's walk compiled without spills (the summaries' bounds
    counted in int); at d = 40, 96 and on packed batches it spilled and stays on backward_wgmma."""
    target = target_for("sm_90")
    documents = {"mask_mod": "doc[b, i] == doc[b, j]", "inputs": {"doc": "int32"}, "dtype": "bf16"}
    for extra in ({"head_dim": 64}, {"head_dim": 64, "dropout": 0.1}, {"head_dim": 128}, {"head_dim": 128, "mask": "causal"}):
        assert solve(Spec(**documents, **extra), target).plans["backward"].family == "backward_wgmma_ws", extra
    for extra in ({"head_dim": 40}, {"head_dim": 96}, {"head_dim": 64, "layout": "packed"}, {"head_dim": 128, "dropout": 0.1}):
        plan = solve(Spec(**documents, **extra), target).plans["backward"]
        assert plan.family == "backward_wgmma", extra
        _, broken = evaluate(family_named("backward_wgmma_ws"), Spec(**documents, **extra), target, "backward", 64, 128, 12)
        assert broken, extra


def test_score_mods_backward_on_sm90_by_their_derivative():
    """backward_wgmma_ws takes a score_mod whose derivative in the score sympy finds to be 1 (an additive bias:
    ALiBi, a bias table), not soft-capping's tanh (its derivative per score spilled the consumers), nor one with
    dropout; those stay on backward_wgmma, whose one plan at d = 128 stays with a modifier or a packed batch and
    dropout (it had fallen to backward_fa2_mma at Br = 16, 1.9-2.4x slower)."""
    target = target_for("sm_90")
    alibi = {"score_mod": "score - slope[h] * (i - j)", "inputs": {"slope": "float32"}}
    softcap = {"score_mod": "cap * tanh(score / cap)", "inputs": {"cap": "scalar"}}
    sinks = {"mask_mod": "j <= i and (i - j < 256 or j < 4)"}
    for head_dim in (64, 96, 128):
        for mods, dropout, family in ((alibi, 0.0, "backward_wgmma_ws"), (alibi, 0.1, "backward_wgmma"),
                                      (softcap, 0.0, "backward_wgmma"), (softcap, 0.1, "backward_wgmma"),
                                      (sinks, 0.1, "backward_wgmma_ws" if head_dim <= 96 else "backward_wgmma")):
            spec = Spec(head_dim=head_dim, dtype="bf16", mask="causal", dropout=dropout, **mods)
            plan = solve(spec, target).plans["backward"]
            assert plan.family == family, (head_dim, mods, dropout, plan)
            if head_dim > 64:
                assert plan.block_r == 64, (head_dim, mods, dropout, plan)
    # packed batches with dropout at d = 97-128: the same one plan (they had taken backward_fa2_mma at Br = 16, or
    # with a modifier backward_wgmma_wide at d = 192, or at an odd d backward_fa2_mma_wide at 160)
    for head_dim, mods in ((112, {}), (100, softcap), (128, alibi), (128, sinks)):
        plan = solve(Spec(head_dim=head_dim, dtype="bf16", mask="causal", dropout=0.1, layout="packed", **mods),
                     target).plans["backward"]
        assert (plan.family, plan.block_r, plan.head_dim) == ("backward_wgmma", 64, 128), (head_dim, mods, plan)
    broken = evaluate(family_named("backward_wgmma_ws"), Spec(head_dim=128, dtype="bf16", **softcap), target,
                      "backward", 64, 128, 12)[1]
    assert any("d score_mod / d score is 1" in b for b in broken)


def test_block_sparse_masks_of_64_key_blocks_keep_warpgroup_mma_at_d_97_to_128():
    """backward_wgmma holds 128 keys at d = 97-128 (64 rows per warpgroup over 8 warps: 4 warps do not fit the
    registers), which a mask of 64-key blocks does not divide; backward_wgmma_wide's 64 keys do (at d = 128).
    Those specs had run on backward_fa2_mma, 1.3x slower. Below d = 97 and for 128-key blocks nothing changes."""
    target = target_for("sm_90")
    for head_dim, block_size, family, computed in ((100, 64, "backward_wgmma_wide", 128), (128, 64, "backward_wgmma_wide", 128),
                                                   (128, 128, "backward_wgmma", 128), (96, 64, "backward_wgmma", 96),
                                                   (64, 64, "backward_wgmma", 64), (192, 64, "backward_wgmma_wide", 192)):
        for dropout in (0.0, 0.1):
            plan = solve(Spec(head_dim=head_dim, dtype="bf16", mask="block_sparse", block_size=block_size,
                              dropout=dropout), target).plans["backward"]
            assert (plan.family, plan.head_dim) == (family, computed), (head_dim, block_size, dropout, plan)
            assert block_size % plan.block_c == 0 and block_size % plan.block_r == 0
    broken = evaluate(family_named("backward_wgmma_wide"), Spec(head_dim=128, dtype="bf16", mask="causal"), target,
                      "backward", 64, 64, 8)[1]
    assert any("head dims above 128" in b for b in broken)


def test_d192_forward_takes_112_key_blocks():
    """forward_wgmma's extra tile (Br, Bc) = (128, 112), outside TILE_CHOICES' powers of two, ranks first at d = 192
    (timed faster than 128 x 64, FlashAttention-3's choice there), for what pads to 192 as well; not at other head
    dims, not for a mask_mod read through run-time summaries (ptxas spilled), not for block-sparse masks (112 keys
    divide no block size)."""
    target = target_for("sm_90")
    for extra in ({}, {"mask": "causal", "dropout": 0.1}, {"layout": "packed"}, {"head_dim": 186},
                  {"score_mod": "cap * tanh(score / cap)", "inputs": {"cap": "scalar"}}):
        plan = solve(Spec(**{"head_dim": 192, "dtype": "bf16", **extra}), target).plans["forward"]
        assert (plan.family, plan.block_r, plan.block_c, plan.warps, plan.head_dim) == ("forward_wgmma", 128, 112, 8, 192), extra
    for extra in ({"mask_mod": "doc[b, i] == doc[b, j]", "inputs": {"doc": "int32"}},
                  {"mask": "block_sparse", "block_size": 128}, {"head_dim": 256}, {"head_dim": 160}):
        plan = solve(Spec(**{"head_dim": 192, "dtype": "bf16", **extra}), target).plans["forward"]
        assert plan.block_c != 112, extra
    documents = Spec(head_dim=192, dtype="bf16", mask_mod="doc[b, i] == doc[b, j]", inputs={"doc": "int32"})
    broken = evaluate(family_named("forward_wgmma"), documents, target, "forward", 128, 112, 8)[1]
    assert any("Bc = 112" in b for b in broken)


# ---- value_head_dim ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("d, dv", [(192, 128), (64, 128), (96, 64)])
def test_a_value_head_dim_runs_on_tensor_cores_at_the_wider_d(arch, d, dv):
    """The tiles are as wide as the wider of the two head dims (the narrower's columns past its d are zeros);
    only the tensor-core templates take two head dims."""
    spec = Spec(head_dim=d, value_head_dim=dv, dtype="bf16", mask="causal", arch=arch)
    solution = solve(spec)
    for pass_name, plan in solution.plans.items():
        assert plan.tensor_cores and plan.head_dim == max(d, dv), (pass_name, plan)
    plain = Spec(head_dim=d, dtype="bf16", mask="causal", arch=arch)
    assert any(not family.tensor_cores for family in solver.families_for(plain, "backward"))   # the CUDA-core ones
    assert all(family.tensor_cores for family in solver.families_for(spec, "backward"))


def test_a_narrower_value_head_dim_narrows_forward_wgmmas_footprint():
    """forward_wgmma's V tiles and O accumulators at value_tile_dim (Dv): its sympy footprint, substituted."""
    spec = Spec(head_dim=192, value_head_dim=72, dtype="bf16")
    family = family_named("forward_wgmma")
    plan, broken = evaluate(family, spec, target_for("sm_90"), "forward", 128, 112, 8)
    assert solver.value_tile_dim(family, spec, plan.head_dim) == 96   # 72 padded to whole 32-column panels
    values = {Br: 128, Bc: 112, d: 192, W: 8, solver.E: 2, solver.Dv: 96}
    assert plan.smem_bytes == int(family.smem_bytes.subs(values)) < int(family.smem_bytes.subs({**values, solver.Dv: 192}))
    assert plan.registers_estimate == int(sp.ceiling(family.registers.subs(values)))
    assert solver.value_tile_dim(family_named("backward_wgmma_ws"), spec, 192) == 192   # (V padded there)


def test_the_wide_backward_narrows_dv_in_whole_panels_per_warpgroup():
    """backward_wgmma_wide splits dV's dims between its two warpgroups: each share must start on a panel of dO_i's
    tile (32 columns at d = 192's 64-byte panels, 64 at d = 256's 128-byte ones)."""
    wide = family_named("backward_wgmma_wide")
    for (head_dim, value_dim), tile in {(192, 128): 128, (192, 72): 128, (192, 24): 64, (256, 128): 128,
                                        (256, 200): 256, (192, 192): 192}.items():
        spec = Spec(head_dim=head_dim, value_head_dim=value_dim, dtype="bf16")
        assert solver.value_tile_dim(wide, spec, head_dim) == tile, (head_dim, value_dim)


# ---- fp8_e4m3 ---------------------------------------------------------------------------------
@pytest.mark.parametrize("head_dim", [64, 128, 192, 256])
def test_fp8_runs_on_the_fp8_families_with_whole_64_byte_panels(head_dim):
    """d = 128 on the warp-specialized build (the producer writes V^T), the other head dims on forward_wgmma's."""
    spec = Spec(head_dim=head_dim, dtype="fp8_e4m3", mask="causal")
    plan = solve(spec).plans["forward"]
    name = "forward_wgmma_ws_fp8" if head_dim == 128 else "forward_wgmma_fp8"
    assert plan.family == name and plan.block_c % 64 == 0 and plan.head_dim in (None, head_dim)
    assert family_named(name).dtypes == ("fp8_e4m3",)
    # Q, two stages of K and V, two of V^T, in bytes (E = 1), + the swizzle atoms' 1 KB (+ the ws build's mbarriers
    # and hand-over words)
    r, c = plan.block_r, plan.block_c
    extra = 72 + 16 + 16 if head_dim == 128 else 0
    assert plan.smem_bytes - 1024 - extra == r * head_dim + 2 * c * 2 * head_dim + 2 * c * head_dim
    # both take fp8 by dtype; the warp-specialized build's d = 128 is one of its tile rules
    assert {f.name for f in families_for(spec, "forward")} == {"forward_wgmma_fp8", "forward_wgmma_ws_fp8"}


def test_no_16_bit_family_takes_fp8():
    assert [f.name for f in FAMILIES if "fp8_e4m3" in f.dtypes] == ["forward_wgmma_fp8", "forward_wgmma_ws_fp8"]


def test_a_latent_spec_runs_on_the_latent_decode_with_its_footprint():
    """576 / 512: 4 warps over 32-key tiles, two blocks per multiprocessor; shared memory is Q, two K stages (V is
    their first 512 columns, no tile of its own), the P~ tile and the warps' row statistics, byte for byte the
    template's carve-up."""
    spec = Spec(head_dim=576, value_head_dim=512, latent_kv=True, dtype="bf16", mask="padding")
    plan = solve(spec).plans["decode"]
    assert (plan.family, plan.block_r, plan.block_c, plan.warps, plan.head_dim) == ("decode_latent_mma", 16, 32, 4, 576)
    assert plan.smem_bytes == 2 * (16 * 584 + 2 * 32 * 584 + 16 * 40) + 4 * 4 * 16
    assert 2 * plan.smem_bytes <= target_for("sm_90").smem_per_sm
    # the other decode templates are not offered a latent cache, nor this one a plain decode spec
    plain = Spec(head_dim=128, dtype="bf16", passes=["forward", "decode"])
    assert solve(plain).plans["decode"].family != "decode_latent_mma"
