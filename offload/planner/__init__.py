"""The planner: where each unit's weights live and where it computes, within a budget, and what that costs.

types (Budget, Workload, Plan), placement (what the executor runs), costs (the cost model; pipeline, the step's
timeline it prices), search (the placement search; residents, the counts of GPU residents it weighs; streams, what
streams in each phase; spill, host memory and the spill to disk), request (PlanRequest and plan_for: the one entry
point), text (table, explanation).
Pure arithmetic: nothing here imports torch.
"""

from offload.errors import PlanError
from offload.planner.costs import PhaseCost
from offload.planner.placement import Placement, UnitPlacement
from offload.planner.request import PlanRequest, plan_for, plan_spec
from offload.planner.search import plan, plan_best_batch
from offload.planner.types import COMPUTE_MODES, PHASES, TIERS, Budget, Plan, TierUsage, UnitPlan, Workload

__all__ = ["Budget", "Workload", "Plan", "UnitPlan", "TierUsage", "PhaseCost", "PlanError", "Placement",
           "UnitPlacement", "PlanRequest", "plan_for", "plan_spec", "plan", "plan_best_batch", "TIERS", "PHASES",
           "COMPUTE_MODES"]
