"""Live redeploy: change the instances' roles on the same devices without losing a request.

The change runs in two phases, so that every stage is held by some instance that takes
work at every moment:

1. **expand** — every instance that gains stages builds what they need (model parts,
   pools) while it goes on serving its old stages, and then takes work for both; pools
   are shared again between all instances;
2. **shrink** — every instance stops taking work for the stages it loses (the router
   sees its new role), hands the requests it holds in those stages on through the normal
   offer/pull path (running decodes at once; work already started in a stage finishes
   that stage first; offers it received for them and has not pulled go on as they came,
   back to their source when that runs the stage now), and once nothing of them is left
   frees what it no longer needs.

Instances are matched to the new roles so that as few stages as possible move.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hydrad.cluster.deploy import STAGES

# Beyond this many instances the roles are matched in order (the search is factorial).
_MAX_MATCHED = 8


@dataclass(frozen=True)
class RoleChange:
    instance_id: int
    old: str
    new: str

    @property
    def union(self) -> str:
        return "".join(s for s in STAGES if s in self.old or s in self.new)

    @property
    def gains(self) -> str:
        return "".join(s for s in STAGES if s in self.new and s not in self.old)

    @property
    def loses(self) -> str:
        return "".join(s for s in STAGES if s in self.old and s not in self.new)


def plan_redeploy(old_roles: list[str], new_roles: list[str]) -> list[RoleChange]:
    """The new role of each instance (by position in ``old_roles``), matching instances to
    roles so that the fewest stages are gained or lost. Instances whose role stays are
    left out."""
    if len(old_roles) != len(new_roles):
        raise ValueError(f"the deployment has {len(old_roles)} instance(s); the new one {len(new_roles)} "
                         "(a redeploy keeps the devices)")

    def cost(order) -> int:
        return sum(len(set(old) ^ set(new)) for old, new in zip(old_roles, order))

    if len(new_roles) <= _MAX_MATCHED:
        best = min(itertools.permutations(new_roles), key=cost)
    else:
        best = tuple(new_roles)
    return [RoleChange(i, old, new) for i, (old, new) in enumerate(zip(old_roles, best)) if old != new]


def format_deploy(roles: list[str]) -> str:
    """``["PD", "E", "PD"]`` -> ``"1E+2PD"``: roles in the order of their stages (E, EP, EPD,
    ED, P, PD, D), as deployments are usually written (``1EP+1D``, ``1E+1P+1D``)."""
    counts = {role: roles.count(role) for role in set(roles)}
    order = sorted(counts, key=lambda role: [STAGES.index(s) for s in role])
    return "+".join(f"{counts[role]}{role}" for role in order)
