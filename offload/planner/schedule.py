"""The schedule of one step, as data: which unit is copied into which staging slot when, which runs where, and where
the hidden state changes device. The planner makes it from a placement; the plan carries it (JSON, --explain);
the executor's log of one step is tested against it (tests/test_overlap.py), and the executor's streamer and the
pricer take the rule of what is copied ahead from here (copied_ahead). No torch.

The rules, once: streamed units take the staging slots in turn (unit j of a step's streamed units, slot j mod
depth); the copy of streamed unit j + depth is issued as soon as unit j is released (its compute enqueued), into
the slot it leaves; past the step's last streamed unit, the next step's first units are copied ahead while they
are in host RAM (a disk unit waits for its read, at its step). A CPU unit's copies in flight run under its compute.
"""

from __future__ import annotations

from dataclasses import dataclass

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
            when = {"start": "at step start", AHEAD: "in the step before"}.get(self.issued, f"when {self.issued} "
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


def phase_schedule(phase: str, units: list[tuple[str, str, str]], depth: int, steady: bool) -> PhaseSchedule:
    """The schedule of one step of phase for units in order as (name, mode in this phase, weight tier); steady: a
    step after one like it (decode), whose first host-RAM units were copied ahead by the step before."""
    streamed = [name for name, mode, _ in units if mode == "stream"]
    turn = {name: j for j, name in enumerate(streamed)}  # each streamed unit's place in the step's streamed ones
    tier = {name: weights for name, _, weights in units}
    depth = min(depth, len(streamed))
    ahead = copied_ahead([tier[n] == "disk" for n in streamed], depth) if steady else 0
    actions = [Action("copy", streamed[j], slot=j % depth, issued=AHEAD if j < ahead else "start")
               for j in range(depth)]
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
        nxt = j + depth
        if nxt < len(streamed):
            actions.append(Action("copy", streamed[nxt], slot=nxt % depth, issued=name))
        elif steady and nxt - len(streamed) < ahead:  # the next step's unit, into the slot it will take
            actions.append(Action("copy", streamed[nxt - len(streamed)], "next step", j % depth, issued=name))
    return PhaseSchedule(phase, depth, tuple(actions))


def copied_ahead(on_disk: list[bool], depth: int) -> int:
    """How many of a step's first streamed units the step before copies ahead (on_disk: each streamed unit's, in
    order): those in host RAM, up to the first disk unit (its read belongs to its own step), at most depth. The
    executor's streamer and the pricer both take it from here."""
    n = 0
    while n < min(depth, len(on_disk)) and not on_disk[n]:
        n += 1
    return n
