"""Autotuning without a GPU: `apply` of a chosen winner and the choice of the fastest candidate, with the GPU session (compile, inputs, CUDA-event timing) replaced by fake timings."""
import json
import types

import pytest

from fagen import solver, tuning
from fagen.bench import autotune
from fagen.spec import Spec
from fagen.target import target_for

GPU = "NVIDIA H200"
SPEC = Spec(name="d64_bf16", head_dim=64, dtype="bf16")


pytestmark = pytest.mark.usefixtures("cache_dir")   # conftest.py: a fresh FAGEN_CACHE_DIR per test


@pytest.fixture
def solution():
    return solver.solve(SPEC, target_for("sm_90"))


def fast_rank(pass_name):
    """The rank the fake timings make fastest: the 3rd (or the last, where the solver has fewer)."""
    return min(3, len(SOLVED.candidates[pass_name]))


def fake_measure(fail=()):
    """ms per candidate: the solver's first choice slowest, fast_rank() fastest; ranks in `fail` raise."""
    calls = []

    def measure(pass_name, candidate):
        plan = candidate.plans[pass_name]
        ranked = list(SOLVED.candidates[pass_name])
        rank = ranked.index(plan) + 1
        calls.append((pass_name, rank))
        assert all(candidate.plans[p] == SOLVED.plans[p] for p in candidate.plans if p != pass_name)
        if rank in fail:
            raise RuntimeError(f"nvcc failed for rank {rank}")
        if rank == fast_rank(pass_name):
            return 1.0
        return 3.0 if rank == 1 else 2.0 + rank

    measure.calls = calls
    return measure


SOLVED = solver.solve(SPEC, target_for("sm_90"))


def fake_session(measure):
    return lambda spec, seqlen, batch, heads, warmup, repeats: autotune.Session(
        spec, SOLVED.target, SOLVED, GPU, measure)


# ---- choosing -----------------------------------------------------------------------------------
def test_select_picks_the_fastest_and_records_every_timing(solution):
    assert all(len(solution.candidates[p]) >= 4 for p in solution.plans), "the test wants 4 candidates a pass"
    measure = fake_measure(fail=(2,))
    chosen = autotune.select(solution, measure, top=4)
    assert set(chosen) == {"forward", "backward"}
    for pass_name, winner in chosen.items():
        third = solution.candidates[pass_name][2]
        assert (winner["block_r"], winner["block_c"], winner["warps"]) == (third.block_r, third.block_c, third.warps)
        assert winner["family"] == third.family and winner["ms"] == 1.0 and winner["solver_ms"] == 3.0
        assert winner["speedup_over_solver"] == pytest.approx(3.0)
        assert [t["rank"] for t in winner["timings"]] == [1, 2, 3, 4]
        assert winner["timings"][1]["ms"] is None and "rank 2" in winner["timings"][1]["error"]
    assert sorted(measure.calls) == sorted((p, r) for p in ("forward", "backward") for r in (1, 2, 3, 4))


def test_select_honours_top_and_passes_and_breaks_ties_by_rank(solution):
    measure = fake_measure()
    chosen = autotune.select(solution, measure, top=2, passes=["backward"])
    assert list(chosen) == ["backward"] and len(chosen["backward"]["timings"]) == 2
    flat = autotune.select(solution, lambda p, c: 1.0, top=3)
    assert all(w["block_r"] == solution.plans[p].block_r and w["block_c"] == solution.plans[p].block_c
               for p, w in flat.items())


def test_select_leaves_out_a_pass_where_nothing_ran(solution):
    def broken(pass_name, candidate):
        raise RuntimeError("no GPU")

    assert autotune.select(solution, broken, top=2) == {}


def test_apply_swaps_in_the_cached_winner(solution):
    chosen = autotune.select(solution, fake_measure(), top=4)
    tuned = tuning.apply(solution, {"passes": chosen})
    for pass_name in ("forward", "backward"):
        assert tuned.plans[pass_name] == solution.candidates[pass_name][fast_rank(pass_name) - 1]
        assert tuned.candidates[pass_name] == solution.candidates[pass_name]
    assert tuning.apply(tuned, {"passes": chosen}) == tuned  # idempotent


def test_apply_ignores_stale_partial_and_missing_entries(solution):
    assert tuning.apply(solution, None) is solution
    stale = {"passes": {"forward": {"family": "forward_fa2_simt", "block_r": 48, "block_c": 48, "warps": 4,
                                    "stages": 1},
                        "backward": {"family": "backward_tensor_core_v0", "block_r": 64, "block_c": 64,
                                     "warps": 4, "stages": 1},
                        "sideways": {"block_r": 64, "block_c": 64, "warps": 4}}}
    assert tuning.apply(solution, stale).plans == solution.plans
    second = solution.candidates["forward"][1]
    partial = {"passes": {"forward": {"block_r": second.block_r, "block_c": second.block_c, "warps": second.warps}}}
    tuned = tuning.apply(solution, partial)
    assert tuned.plans["forward"] == second and tuned.plans["backward"] == solution.plans["backward"]
    forward_only = solver.solve(SPEC.model_copy(update={"passes": ("forward",)}), target_for("sm_90"))
    assert "backward" not in tuning.apply(forward_only, {"passes": {"backward": {"block_r": 64, "block_c": 64,
                                                                                   "warps": 8}}}).plans


# ---- autotune end to end with fake timings ---------------------------------------------------------
def test_autotune_round_trip_through_the_cache_file(monkeypatch, cache_dir):
    measure = fake_measure()
    monkeypatch.setattr(autotune, "open_session", fake_session(measure))
    entry = autotune.autotune(SPEC, top=3, seqlen=4096)
    assert entry["gpu"] == GPU and entry["shape"] == {"batch": 4, "heads": 32, "seqlen": 4096}
    assert (cache_dir / "autotune.json").exists()
    cached = tuning.lookup(SPEC, GPU)
    assert cached == json.loads(json.dumps(entry))
    tuned = tuning.apply(solver.solve(SPEC, target_for("sm_90")), cached)
    assert tuned.plans["forward"] == SOLVED.candidates["forward"][fast_rank("forward") - 1]
    assert tuned.plans["backward"] == SOLVED.candidates["backward"][fast_rank("backward") - 1]
    assert tuning.lookup(SPEC, "some other GPU") is None


def test_autotune_of_one_pass_keeps_the_other_pass_cached(monkeypatch):
    monkeypatch.setattr(autotune, "open_session", fake_session(fake_measure()))
    autotune.autotune(SPEC, top=4, seqlen=4096)
    monkeypatch.setattr(autotune, "open_session", fake_session(lambda pass_name, candidate: 1.0))
    entry = autotune.autotune(SPEC, top=4, seqlen=4096, passes=["forward"])
    assert list(entry["passes"]) == ["forward"]
    cached = tuning.lookup(SPEC, GPU)["passes"]
    assert cached["forward"]["block_r"] == SOLVED.plans["forward"].block_r  # re-tuned: all tie, solver's wins
    assert cached["forward"]["block_c"] == SOLVED.plans["forward"].block_c
    third = SOLVED.candidates["backward"][fast_rank("backward") - 1]
    assert (cached["backward"]["block_r"], cached["backward"]["block_c"]) == (third.block_r, third.block_c)


def test_autotune_stores_nothing_when_no_candidate_ran(monkeypatch, cache_dir):
    monkeypatch.setattr(autotune, "open_session", fake_session(fake_measure(fail=(1, 2, 3, 4))))
    entry = autotune.autotune(SPEC, top=4, seqlen=1024, batch=2, heads=3)
    assert entry["passes"] == {} and entry["shape"] == {"batch": 2, "heads": 3, "seqlen": 1024}
    assert tuning.lookup(SPEC, GPU) is None


def test_compile_tuned_swaps_the_winner_into_the_runtime_kernel(monkeypatch):
    from fagen import jit

    target = target_for("sm_90")
    gpu_target = type(target)(**{**target.__dict__, "name": GPU})
    base = types.SimpleNamespace(spec=SPEC, target=gpu_target, solution=SOLVED)
    built = []

    class FakeKernel:
        def __init__(self, spec, target, solution):
            built.append(solution)
            self.spec, self.target, self.solution = spec, target, solution

    monkeypatch.setattr(jit, "compile", lambda spec: base)
    monkeypatch.setattr(jit, "solution", lambda kernel: kernel.solution)
    monkeypatch.setattr(jit, "kernel_for", FakeKernel)
    monkeypatch.setattr(autotune, "_tuned_kernels", {})
    assert autotune.compile_tuned(SPEC) is base  # nothing cached: the runtime's own kernel
    chosen = autotune.select(SOLVED, fake_measure(), top=4)
    tuning.store(SPEC, GPU, {"passes": chosen})
    kernel = autotune.compile_tuned(SPEC)
    assert kernel.solution.plans["forward"] == SOLVED.candidates["forward"][fast_rank("forward") - 1]
    assert autotune.compile_tuned(SPEC) is kernel and len(built) == 1  # built once per process


def test_autotune_refuses_a_latent_cache_by_name_before_timing_anything():
    with pytest.raises(ValueError, match="latent cache .latent_kv.*python -m fagen.bench mla-decode"):
        autotune.autotune(Spec(head_dim=576, value_head_dim=512, latent_kv=True, dtype="bf16"))


def test_autotune_refuses_fp8_by_name_before_timing_anything():
    with pytest.raises(ValueError, match="fp8_e4m3, which this timing does not take; python -m fagen.bench fp8"):
        autotune.autotune(Spec(head_dim=128, dtype="fp8_e4m3"))
