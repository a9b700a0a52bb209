"""What a role's layout is, without any process group: the sizes of every parallel dimension (`LayoutSpec`) and
which global ranks form each group (`rank_tables`). Pure functions (no torch.distributed), so the dry-run planner
prints the same tables the workers build their groups from (layout.py).

Rank order (local index ``i`` inside the layout's block of ranks, fastest-varying dimension first):

* dense layers (attention, norms, embeddings):  ``i = ((pp * DP + dp) * CP + cp) * TP + tp``
* expert layers, folded over the same ranks:     ``i = ((pp * EDP + edp) * EP + ep) * ETP + etp``

so within one pipeline stage the ``TP*CP*DP`` dense ranks are re-read as ``ETP*EP*EDP`` expert ranks (Megatron's
"MoE parallel folding"). TP neighbours are adjacent ranks, which keeps the chattiest groups inside one node.
"""

from __future__ import annotations

from dataclasses import dataclass

DENSE_DIMS = ("tp", "cp", "dp", "pp")
EXPERT_DIMS = ("etp", "ep", "edp", "pp")

# Groups a Layout builds, each a list of dims (from one of the two orders above) whose ranks vary inside the group.
GROUP_DIMS: dict[str, tuple[str, ...]] = {
    "tp": ("tp",),
    "cp": ("cp",),
    "dp": ("dp",),
    "pp": ("pp",),
    "dp_cp": ("cp", "dp"),  # dense gradient reduction when context parallel is on
    "tp_cp": ("tp", "cp"),  # the ranks sharing one DP replica's micro batch tokens (MoE router loss statistics)
    "mp": ("tp", "pp"),  # model-parallel group: one full copy of the dense weights (for CP=1)
    "etp": ("etp",),
    "ep": ("ep",),
    "edp": ("edp",),
    "ep_etp": ("etp", "ep"),  # token dispatch group of the MoE layers
    "world": ("tp", "cp", "dp", "pp"),  # every rank of the layout (checkpoints; other roles' ranks take no part)
}
GROUP_NAMES = (*GROUP_DIMS, "embedding")


class LayoutError(ValueError):
    """An impossible parallel layout; the message names the sizes and what must divide what."""


@dataclass(frozen=True)
class LayoutSpec:
    """Sizes of every parallel dimension for one role. `dp` and `edp` are derived."""

    world_size: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1

    def __post_init__(self) -> None:
        for name in ("world_size", "tp", "pp", "vpp", "cp", "ep", "etp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name}={value!r}: every parallel size must be a positive integer")
        model_parallel = self.tp * self.cp * self.pp
        if self.world_size % model_parallel:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by TP*CP*PP = {self.tp}*{self.cp}*{self.pp}"
            )
        per_stage = self.world_size // self.pp
        if per_stage % (self.ep * self.etp):
            raise LayoutError(
                f"EP*ETP = {self.ep}*{self.etp} does not divide world/PP = {self.world_size}/{self.pp} = {per_stage}"
            )
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError(f"virtual pipeline size {self.vpp} needs pipeline size > 1")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.cp * self.pp)

    @property
    def edp(self) -> int:
        return self.world_size // (self.etp * self.ep * self.pp)

    def sizes(self, order: tuple[str, ...]) -> tuple[int, ...]:
        return tuple(getattr(self, dim) for dim in order)

    def coords(self, local_rank: int) -> dict[str, int]:
        """Every dimension's rank for the layout-local index `local_rank` (see the module docstring)."""
        coords: dict[str, int] = {}
        for order in (DENSE_DIMS, EXPERT_DIMS):
            rest = local_rank
            for dim, size in zip(order, self.sizes(order)):
                coords[dim] = rest % size
                rest //= size
        return coords


def _groups_varying(spec: LayoutSpec, dims: tuple[str, ...], ranks: list[int]) -> list[list[int]]:
    """Partition `ranks` into groups whose members differ only in `dims` (members listed in rank order)."""
    order = DENSE_DIMS if dims[0] in DENSE_DIMS else EXPERT_DIMS
    groups: dict[tuple[int, ...], list[int]] = {}
    for local, global_rank in enumerate(ranks):
        coords = spec.coords(local)
        key = tuple(coords[d] for d in order if d not in dims)
        groups.setdefault(key, []).append(global_rank)
    return list(groups.values())


def rank_tables(spec: LayoutSpec, ranks: list[int] | None = None) -> dict[str, list[list[int]]]:
    """Global ranks of every group of the layout, by group name; `ranks` is the layout's block (default 0..N-1)."""
    ranks = list(range(spec.world_size)) if ranks is None else list(ranks)
    if len(ranks) != spec.world_size:
        raise LayoutError(f"layout of world size {spec.world_size} was given {len(ranks)} ranks")
    tables = {name: _groups_varying(spec, dims, ranks) for name, dims in GROUP_DIMS.items()}
    first_last = sorted({0, spec.pp - 1})
    tables["embedding"] = [
        [g[i] for i in first_last] for g in _groups_varying(spec, ("pp",), ranks)
    ]  # tied embedding / LM head across the first and last stage
    return tables
