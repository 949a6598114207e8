"""Stage 1b: the GPU's limits as plain data (tinygrad's habit: hardware is a table, not code).

The solver reads only this. When a GPU is present, `Target.from_device()` reads the same numbers off
it through the CUDA driver (imported lazily so that the CPU pipeline never needs it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Target:
    arch: str                    # "sm_90"
    smem_per_block: int          # bytes a block may opt in to (cudaDevAttrMaxSharedMemoryPerBlockOptin)
    smem_per_sm: int             # bytes of shared memory per multiprocessor
    registers_per_thread: int    # hard ceiling the compiler can give one thread
    registers_per_sm: int
    max_threads_per_sm: int
    sm_count: int
    name: str = "table"

    @property
    def features(self) -> ArchFeatures:
        return arch_features(self.arch)

    def with_sm_count(self, sm_count: int) -> "Target":
        return replace(self, sm_count=sm_count)


# Numbers from the CUDA programming guide's per-compute-capability table; sm_count is a typical
# part (A100, A10/3090, L4/4090, H100 SXM) and only sizes launch grids, never correctness.
TARGETS: dict[str, Target] = {
    "sm_80": Target("sm_80", 166912, 167936, 255, 65536, 2048, 108, "A100 (table)"),
    "sm_86": Target("sm_86", 101376, 102400, 255, 65536, 1536, 84, "GA10x (table)"),
    "sm_89": Target("sm_89", 101376, 102400, 255, 65536, 1536, 128, "AD10x (table)"),
    "sm_90": Target("sm_90", 232448, 233472, 255, 65536, 2048, 132, "H100 (table)"),
}


@dataclass(frozen=True)
class ArchFeatures:
    """What an architecture's instructions allow, as the templates and the compiler use it."""

    nvcc_arch: str               # what nvcc builds for: sm_90 as sm_90a, Hopper's arch-specific profile
    warpgroup_mma: bool = False  # wgmma.mma_async (the forward_wgmma / backward_wgmma families)
    fp8_mma: bool = False        # e4m3 operands of warpgroup MMA (dtype fp8_e4m3)
    setmaxnreg: bool = False     # registers moved between warpgroups (the warp-specialized families)
    tma: bool = False            # cp.async.bulk.tensor with tensor maps (forward_wgmma_ws)


#: The one table of architecture facts. An arch it does not list (a newer GPU's) has none of the features and
#: builds for its own name.
ARCH_FEATURES: dict[str, ArchFeatures] = {
    "sm_80": ArchFeatures("sm_80"),
    "sm_86": ArchFeatures("sm_86"),
    "sm_89": ArchFeatures("sm_89"),
    "sm_90": ArchFeatures("sm_90a", warpgroup_mma=True, fp8_mma=True, setmaxnreg=True, tma=True),
}


def arch_features(arch: str) -> ArchFeatures:
    return ARCH_FEATURES.get(arch) or ArchFeatures(arch)


def target_for(arch: str) -> Target:
    try:
        return TARGETS[arch]
    except KeyError:
        raise ValueError(f"unknown arch {arch!r}: allowed {', '.join(TARGETS)}") from None


def from_attributes(values: dict) -> Target:
    """The limits of a live GPU, from what the runtime read off it (fagen.cuda_driver.device_attributes): this
    module holds the facts and never touches the driver, so that planning never needs a GPU."""
    return Target(
        arch=f"sm_{values['cc_major']}{values['cc_minor']}",
        smem_per_block=values["smem_per_block"],
        smem_per_sm=values["smem_per_sm"],
        registers_per_thread=255,
        registers_per_sm=values["registers_per_sm"],
        max_threads_per_sm=values["max_threads_per_sm"],
        sm_count=values["sm_count"],
        name=values["name"],
    )
