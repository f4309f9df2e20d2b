"""Forged work for the demo's cheating worker and the tests: each is an edit a dishonest worker
could make to its own submission before signing it. Every one of them must end in a hard
rejection and a slash (tests/integration/test_judge.py holds the detection matrix).

``ROGUES`` are a dishonest validator's edits of its own judgement (tests only): the other
validators' re-judging must catch each one with a dispute (tests/integration/test_validators.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from node.roles.judge import JudgeContext, Judgement
from swarm.errors import ConfigError
from swarm.messages import RolloutSubmission, Sample, Signed

Cheat = Callable[[RolloutSubmission], RolloutSubmission]


def _edit_first(
    submission: RolloutSubmission, edit: Callable[[Sample], Sample]
) -> RolloutSubmission:
    return dataclasses.replace(
        submission, samples=(edit(submission.samples[0]), *submission.samples[1:])
    )


def edit_token(submission: RolloutSubmission) -> RolloutSubmission:
    """Change one generated token and keep the proofs (the sampling check catches it)."""
    return _edit_first(
        submission,
        lambda s: dataclasses.replace(s, tokens=(s.tokens[0] ^ 1, *s.tokens[1:])),
    )


def wrong_seed(submission: RolloutSubmission) -> RolloutSubmission:
    """Claim another seed than the assigned one (the assignment check catches it)."""
    return _edit_first(submission, lambda s: dataclasses.replace(s, seed=s.seed + 1))


def false_finish(submission: RolloutSubmission) -> RolloutSubmission:
    """Cut the output short and report it finished (the termination check catches it)."""
    return _edit_first(
        submission, lambda s: dataclasses.replace(s, tokens=s.tokens[:1], finish_reason="stop")
    )


def unassigned_prompts(submission: RolloutSubmission) -> RolloutSubmission:
    """Answer prompts of its own choosing (the assignment check catches it)."""
    return dataclasses.replace(
        submission, prompt_ids=tuple(str(i) for i in range(len(submission.prompt_ids)))
    )


CHEATS: dict[str, Cheat] = {
    "edit-token": edit_token,
    "wrong-seed": wrong_seed,
    "false-finish": false_finish,
    "unassigned-prompts": unassigned_prompts,
}


def cheat_by_name(name: str) -> Cheat:
    try:
        return CHEATS[name]
    except KeyError:
        raise ConfigError(f"unknown cheat {name!r}; one of {', '.join(CHEATS)}") from None


def credit_everything(
    submission: Signed[RolloutSubmission], judgement: Judgement, ctx: JudgeContext
) -> Judgement:
    """A validator that accepts work it found forged (say, paid by the cheater): a credit and a
    trainer hand-off for work that replays to a hard rejection."""
    if judgement.accepted or judgement.severity != "hard":
        return judgement
    return Judgement(True, "none", [], [0.0] * len(submission.message.samples), {"rogue": 1})


Rogue = Callable[[Signed[RolloutSubmission], Judgement, JudgeContext], Judgement]
ROGUES: dict[str, Rogue] = {"credit-everything": credit_everything}


def rogue_by_name(name: str) -> Rogue:
    try:
        return ROGUES[name]
    except KeyError:
        raise ConfigError(f"unknown validator cheat {name!r}; one of {', '.join(ROGUES)}") from None


TRAINER_CHEATS = (
    "unaccepted-sample",
    "drop-worker",
    "learning-rate",
    "perturb-weights",
    "forge-gradient",
)
"""A rogue trainer's edits of its own steps (tests only); the training audit must catch each
with a ``training-dispute`` (tests/integration/test_training_audit.py):

- ``unaccepted-sample``: train one more group, cited by a verdict id no validator signed;
- ``drop-worker``: leave the first worker seen out of the step (its receipted work waits while
  later work trains);
- ``learning-rate``: step with ten times the genesis's learning rate;
- ``perturb-weights``: publish weights a little off the step's result;
- ``forge-gradient`` (a member of several trainers): send the group the negated gradient of its
  samples, and commit to it (tests/integration/test_trainer_averaging.py and
  tests/system/test_trainer_group.py)."""


@dataclasses.dataclass(frozen=True)
class TrainerCheat:
    """Which cheat a rogue trainer applies at which step (keyed by the version stepped from;
    ``always``: at every step; ``first``: on the first ``count`` steps that train samples of
    its own with signal, ``picked`` keeping which)."""

    plan: dict[int, str] = dataclasses.field(default_factory=dict)
    always: str | None = None
    first: str | None = None
    count: int = 0
    picked: set[int] = dataclasses.field(default_factory=set)

    def at(self, step: int) -> str | None:
        return self.plan.get(step, self.always)

    def pick(self, step: int, samples: int) -> str | None:
        """The cheat of ``step``, training ``samples`` groups of this trainer with signal
        (``Group.signal``: a group whose rewards are all equal gives no gradient, and its
        commitment counts no samples, so a cheat there tests nothing). A step picked once stays
        picked (a round tried again cheats again)."""
        if self.first is not None and (
            step in self.picked or (samples > 0 and len(self.picked) < self.count)
        ):
            self.picked.add(step)
            return self.first
        return self.at(step)


def trainer_cheat_by_spec(spec: str) -> TrainerCheat:
    """``NAME`` (every step), ``NAME@STEP[,NAME@STEP...]`` (the step's parent version), or
    ``NAME*K``: the first K steps that train samples of this trainer (a member of several
    trainers may have none in a round; a plan by step number may then test nothing)."""
    plan: dict[int, str] = {}
    always = first = None
    count = 0
    for part in spec.split(","):
        name, _, times = part.strip().partition("*")
        name, _, at = name.partition("@")
        if name not in TRAINER_CHEATS:
            raise ConfigError(f"unknown trainer cheat {name!r}; one of {', '.join(TRAINER_CHEATS)}")
        if times:
            if at or not times.isdigit() or int(times) < 1:
                raise ConfigError(f"trainer cheat {part!r}: after * comes a count, 1 or more")
            first, count = name, int(times)
        elif not at:
            always = name
        else:
            try:
                plan[int(at)] = name
            except ValueError:
                raise ConfigError(f"trainer cheat {part!r}: the step after @ is a number") from None
    return TrainerCheat(plan, always, first, count)
