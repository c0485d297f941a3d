"""The (pp, dp, tp) device mesh of a torchrun world, built once from a plan, and its groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopart.core.errors import PlanError
from autopart.core.plan import Plan
from autopart.core.plan_rules import overlaps_expert_exchanges

__all__ = ["MESH_DIMS", "MeshGroups", "check_world", "build_mesh", "context_group",
           "mesh_groups"]

#: The dimension names, outermost first: tp innermost, so a tp group's ranks are adjacent
#: (inside one host, as Megatron-LM places them; torchtitan's mesh uses the same order).
MESH_DIMS = ("pp", "dp", "tp")

_MESHES: dict[tuple[str, int, int, int], DeviceMesh] = {}
_EXPERT_GROUPS: dict[tuple[Any, ...], tuple[dist.ProcessGroup | None,
                                            dist.ProcessGroup | None]] = {}


@dataclass(frozen=True)
class MeshGroups:
    """The process groups a rank's runtime needs, and the degrees they were made for.

    Attributes:
        mesh: the device mesh (a user's 2-D ``("pp", "dp")`` one, the 3-D one
            :func:`build_mesh` made), or None when the world is one pipeline.
        pp_group: ranks sharing this rank's (dp, tp) coordinates, in stage order (None: the
            world).
        dp_group: ranks sharing its (pp, tp) coordinates: its data-parallel replicas, or
            None when dp = 1.
        tp_group: ranks sharing its (pp, dp) coordinates, or None when tp = 1.
        pp, dp, tp: the degrees.
        ep: the expert-parallel degree (1: none).
        ep_group: the ep consecutive replicas of this rank's dp group that split the
            experts between them (:func:`expert_groups`), or None when ep = 1.
        edp_group: the dp / ep replicas holding the same experts as this rank (one per ep
            group), or None when there is one.
        cp: the context-parallel degree (1: none). With cp > 1 the mesh's dp dimension holds
            dp x cp ranks (``dp`` above is its size): each dp replica is cp consecutive ranks
            of it holding the same rows and different tokens (:func:`context_group`).
        cp_group: this rank's cp group, or None when cp = 1.
        ep_chunk_group: a second group of ``ep_group``'s ranks, for the all-to-alls of the
            second V chunk's stages where DualPipe-V's pairs overlap them
            (:func:`autopart.core.plan_rules.overlaps_expert_exchanges`; the two chunks'
            collectives then run on two threads, each keeping one order on its own group);
            None otherwise.
    """

    mesh: DeviceMesh | None
    pp_group: dist.ProcessGroup | None
    dp_group: dist.ProcessGroup | None
    tp_group: dist.ProcessGroup | None
    pp: int
    dp: int
    tp: int
    ep: int = 1
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    cp: int = 1
    cp_group: dist.ProcessGroup | None = None
    ep_chunk_group: dist.ProcessGroup | None = None

    @property
    def dp_rank(self) -> int:
        """This rank's replica index, 0 .. dp - 1."""
        return dist.get_rank(self.dp_group) if self.dp_group is not None else 0


def check_world(world: int, tp: int, pp: int, dp: int) -> None:
    """The torchrun world must hold exactly tp x pp x dp ranks.

    Raises:
        PlanError: naming the degrees, their product, the world size and the
            ``--nproc-per-node`` that fixes it (on one host).
    """
    if min(tp, pp, dp) < 1 or tp * pp * dp != world:
        raise PlanError(f"the plan's layout tp {tp} x pp {pp} x dp {dp} needs {tp * pp * dp} "
                        f"ranks but this launch has {world}; launch with "
                        f"--nproc-per-node={tp * pp * dp} (on one host; --nnodes x "
                        "--nproc-per-node over several), or re-plan for this world "
                        "(autopart.compile without plan=, or fix tp=/dp=)")


def build_mesh(tp: int, pp: int, dp: int, device_type: str | None = None) -> DeviceMesh:
    """The 3-D mesh ``(pp, dp, tp)`` over the default process group's ranks: global rank
    ``r = (pp_i * dp + dp_i) * tp + tp_i``, so tp ranks are adjacent, then dp, pp outermost.
    Made once per process for given degrees (every rank must call it, in the same order, as
    ``init_device_mesh`` requires); later calls return the same mesh.

    Args:
        tp, pp, dp: the degrees.
        device_type: ``"cuda"`` or ``"cpu"``; default cuda when CUDA is available.

    Raises:
        PlanError: no process group, or a world that is not tp x pp x dp
            (:func:`check_world`).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError("a device mesh needs an initialised process group: launch with torchrun "
                        "(autopart.compile then initialises it) or call init_process_group()")
    check_world(dist.get_world_size(), tp, pp, dp)
    kind = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    key = (kind, pp, dp, tp)
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(kind, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
    return _MESHES[key]


def _dim_size(mesh: DeviceMesh, name: str) -> int:
    names = mesh.mesh_dim_names or ()
    return mesh.size(names.index(name)) if name in names else 1


def _group(mesh: DeviceMesh, name: str) -> dist.ProcessGroup | None:
    names = mesh.mesh_dim_names or ()
    return mesh.get_group(name) if name in names and _dim_size(mesh, name) > 1 else None


def mesh_groups(plan: Plan, mesh: DeviceMesh | None = None) -> MeshGroups:
    """The groups this rank runs ``plan`` with.

    With ``mesh`` (a user's 2-D ``("pp", "dp")`` or a 3-D ``("pp", "dp", "tp")`` mesh): its
    groups; its pp size must be the plan's rank count, and a plan made for dp > 1 or tp > 1
    (a 3D plan) must match its dp and tp sizes (a pp-only plan runs on any dp: each replica
    then feeds the batch the plan was made for). Without one: a plan with tp = dp = 1 runs
    on the whole world as one pipeline (no mesh); any other gets :func:`build_mesh`.

    Raises:
        PlanError: a mesh without a ``pp`` dimension or of other sizes than the plan's, or
            a world of another size than the plan's layout.
    """
    pp, tp, dp = len(plan.ranks), plan.tp, plan.dp * plan.cp  # cp is folded into dp
    if mesh is None:
        if tp == 1 and dp == 1:
            check_world(dist.get_world_size(), 1, pp, 1)
            return MeshGroups(None, None, None, None, pp, 1, 1)
        mesh = build_mesh(tp, pp, dp)
    names = tuple(mesh.mesh_dim_names or ())
    if "pp" not in names or not set(names) <= set(MESH_DIMS):
        raise PlanError(f"mesh dims {names}: expected ('pp', 'dp') or ('pp', 'dp', 'tp'); "
                        "build it with init_device_mesh(..., mesh_dim_names=('pp', 'dp')) or "
                        "leave mesh= out to let autopart build it from the plan")
    sizes = {name: _dim_size(mesh, name) for name in MESH_DIMS}
    wanted = {"pp": pp, **({"dp": dp} if dp > 1 or tp > 1 else {}), "tp": tp}
    for name, size in wanted.items():
        if sizes[name] != size:
            folded = f" (dp {plan.dp} x cp {plan.cp})" if plan.cp > 1 and name == "dp" else ""
            raise PlanError(f"the mesh's {name} dimension has {sizes[name]} ranks but the plan "
                            f"has {name}={size}{folded} (tp {tp} x pp {pp} x dp {dp}); build "
                            "the mesh with the plan's sizes, or leave mesh= out to let autopart "
                            "build it")
    ep_group, edp_group = expert_groups(mesh, plan.ep)
    chunk = None
    if overlaps_expert_exchanges(plan.schedule_kind, plan.ep, plan.tp, plan.cp,
                                 plan.zero_stage):
        chunk = expert_groups(mesh, plan.ep, copy=1)[0]
    return MeshGroups(mesh, mesh.get_group("pp"), _group(mesh, "dp"), _group(mesh, "tp"),
                      pp, sizes["dp"], tp, plan.ep, ep_group, edp_group, plan.cp,
                      context_group(mesh, plan.cp), chunk)


def context_group(mesh: DeviceMesh, cp: int) -> dist.ProcessGroup | None:
    """This rank's cp group: the mesh's dp dimension (dp x cp ranks) cut into groups of cp
    consecutive ranks, as :func:`expert_groups` cuts ep groups (Megatron-LM places cp
    inside dp the same way). None when cp = 1. Every rank creates every group, once per
    process for a mesh and cp.

    Raises:
        PlanError: cp does not divide the mesh's dp size.
    """
    return expert_groups(mesh, cp)[0]


def expert_groups(mesh: DeviceMesh, ep: int, copy: int = 0,
                  ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """This rank's ep and expert-data-parallel groups, folded into the mesh's dp dimension
    as Megatron-Core folds them: each dp group's ranks, in dp order, cut into ``dp / ep``
    ep groups of ``ep`` consecutive replicas; the ranks at the same place of each ep group
    form an expert-data-parallel group (they hold the same experts). Every rank creates
    every group, in the same order (``new_subgroups_by_enumeration``), once per process for
    a mesh and ep (later calls return the same groups).

    ``copy`` > 0 asks for another set of groups of the same ranks (one more process group
    each, made once per copy): the second V chunk's all-to-alls run on copy 1
    (:attr:`MeshGroups.ep_chunk_group`).

    Returns:
        ``(ep_group, edp_group)``: None for a group of one rank (ep = 1; ep = dp).

    Raises:
        PlanError: ep does not divide the mesh's dp size.
    """
    if ep == 1:
        return None, None
    key = (tuple(mesh.mesh.flatten().tolist()), tuple(mesh.mesh.shape), ep, copy)
    if key not in _EXPERT_GROUPS:
        _EXPERT_GROUPS[key] = _new_expert_groups(mesh, ep, with_edp=copy == 0)
    return _EXPERT_GROUPS[key]


def _new_expert_groups(mesh: DeviceMesh, ep: int, with_edp: bool = True,
                       ) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    names = tuple(mesh.mesh_dim_names or ())
    dp = _dim_size(mesh, "dp")
    if "dp" not in names or dp % ep:
        raise PlanError(f"ep={ep} must divide the mesh's dp size ({dp}): expert parallelism "
                        "splits the experts over ep of the dp replicas; re-plan with a divisor")
    lines = mesh.mesh.movedim(names.index("dp"), -1).reshape(-1, dp).tolist()
    eps = [line[j:j + ep] for line in lines for j in range(0, dp, ep)]
    ep_group, _ = dist.new_subgroups_by_enumeration(eps)
    if dp == ep or not with_edp:
        return ep_group, None
    edps = [line[i::ep] for line in lines for i in range(ep)]
    edp_group, _ = dist.new_subgroups_by_enumeration(edps)
    return ep_group, edp_group
