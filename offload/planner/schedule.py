"""The schedule of one step, as data: which unit is copied into which staging slot when, which runs where, and where
the hidden state changes device. The planner makes it from a placement; the plan carries it (JSON, --explain);
the executor's log of one step is tested against it (tests/test_overlap.py). No torch.

The rule of the copies is written once, in copy_plan: the executor's streamer replays it (runtime/streamer.py), the
pricer times it (planner/costs.py) and phase_schedule writes it out with the runs, releases and hand-overs. Streamed units take the staging slots in turn (unit j of a step's streamed units, slot j mod
depth); the copy of streamed unit j + depth is issued as soon as unit j is released (its compute enqueued), into
the slot it leaves; past the step's last streamed unit, the next step's first units are copied ahead while they
are in host RAM (a disk unit waits for its read, at its step). A CPU unit's copies in flight run under its compute.
A step that samples no row (a prefill pass that ends no prompt) runs every unit but the lm_head (step_units): its
copies are those of the units it runs, so the lm_head is neither copied nor read then.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

AHEAD = "ahead"  # a copy issued in the previous step (decode steps and prefill passes repeat)


@dataclass(frozen=True)
class Action:
    """One thing a step does, in the order the executor issues it."""

    op: str  # copy | run | release | hop
    unit: str
    where: str = ""  # run: gpu | cpu; hop: the device the hidden state moves to; copy: "next step" if ahead
    slot: int | None = None  # copy, release: the staging slot (relative to the step's first streamed unit's)
    issued: str = ""  # copy: "start" (as the step begins), AHEAD, or the unit whose release frees the slot

    def __str__(self) -> str:
        if self.op == "copy":
            when = {START: "at step start", AHEAD: "in the step before"}.get(self.issued, f"when {self.issued} "
                                                                                             "is released")
            return f"copy {self.unit} -> slot {self.slot} ({when}{', for the next step' if self.where else ''})"
        if self.op == "release":
            return f"release slot {self.slot} ({self.unit})"
        if self.op == "hop":
            return f"hand over to {self.where}"
        return f"run {self.unit} on {self.where}"


@dataclass(frozen=True)
class PhaseSchedule:
    """One step of a phase: its actions in issue order and the staging depth."""

    phase: str
    depth: int
    actions: tuple[Action, ...]

    @property
    def runs(self) -> tuple[Action, ...]:
        return tuple(a for a in self.actions if a.op == "run")

    def to_list(self) -> list[str]:
        return [str(a) for a in self.actions]


START = "start"  # a copy issued as its step begins


@dataclass(frozen=True)
class Copy:
    """When a streamed unit's copy is issued: at its step's start (by=None, issued=START), in the step before
    (issued=AHEAD, at the release of that step's streamed unit `by`) or at the release of this step's streamed unit
    `by`; units are a step's streamed units' turns (0, 1, ...)."""

    turn: int
    issued: str  # START | AHEAD | "release"
    by: int | None = None


@lru_cache(maxsize=4096)
def copy_plan(on_disk: tuple[bool, ...], depth: int, steady: bool) -> tuple[Copy, ...]:
    """THE rule, for a step whose streamed units' weights are on disk or not (on_disk, in turn): each streamed
    unit's copy, in issue order. Slots are taken in turn, so the copy of turn j + depth goes into the slot turn j
    leaves and is issued at its release; a steady step's first host-RAM units (copied_ahead) were copied in the
    step before, at the release of its turns n - depth + j; the others of the first depth turns at the step's start.
    The executor's streamer replays it, the pricer times it and phase_schedule writes it out."""
    n = len(on_disk)
    depth = min(depth, n)
    ahead = copied_ahead(list(on_disk), depth) if steady else 0
    copies = [Copy(j, AHEAD, n - depth + j) if j < ahead else Copy(j, START) for j in range(depth)]
    return tuple(copies + [Copy(j, "release", j - depth) for j in range(depth, n)])


def step_units(units: list, samples: bool = True) -> list:
    """The units a step runs, of all units in order (the lm_head last): all of them where the step samples a row
    of logits, else all but the lm_head (a prefill pass that ends no prompt computes no logits)."""
    return list(units) if samples else list(units[:-1])


def phase_schedule(phase: str, units: list[tuple[str, str, str]], depth: int, steady: bool,
                   samples: bool = True) -> PhaseSchedule:
    """The schedule of one step of phase for units in order as (name, mode in this phase, weight tier); steady: a
    step after one like it (decode), whose first host-RAM units were copied ahead by the step before; samples:
    whether the step samples a row (else it runs no lm_head)."""
    units = step_units(units, samples)
    streamed = [name for name, mode, _ in units if mode == "stream"]
    turn = {name: j for j, name in enumerate(streamed)}  # each streamed unit's place in the step's streamed ones
    tier = {name: weights for name, _, weights in units}
    depth = min(depth, len(streamed))
    copies = copy_plan(tuple(tier[n] == "disk" for n in streamed), depth, steady)
    actions = [Action("copy", streamed[c.turn], slot=c.turn % depth, issued=c.issued) for c in copies
               if c.issued != "release"]
    after: dict[int, list[Copy]] = {}  # the copies each release issues: this step's, then the next step's
    for c in copies:
        if c.by is not None:
            after.setdefault(c.by, []).append(c)
    device = None
    for name, mode, _ in units:
        where = "cpu" if mode == "cpu" else "gpu"
        if device is not None and where != device:
            actions.append(Action("hop", name, where))
        device = where
        actions.append(Action("run", name, where))
        if mode != "stream":
            continue
        j = turn[name]
        actions.append(Action("release", name, slot=j % depth))
        for c in after.get(j, []):
            nxt = c.turn if c.issued == "release" else c.turn + len(streamed)
            actions.append(Action("copy", streamed[c.turn], "next step" if c.issued == AHEAD else "",
                                  nxt % depth, issued=name))
    return PhaseSchedule(phase, depth, tuple(actions))


def copied_ahead(on_disk: list[bool], depth: int) -> int:
    """How many of a step's first streamed units the step before copies ahead (on_disk: each streamed unit's, in
    order): those in host RAM, up to the first disk unit (its read belongs to its own step), at most depth. The
    executor's streamer and the pricer both take it from here."""
    n = 0
    while n < min(depth, len(on_disk)) and not on_disk[n]:
        n += 1
    return n
