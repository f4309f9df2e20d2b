"""The training audit: check one version's training record against the signed inputs and
replay its step (used by the due validator, ``node.roles.train_audit``, and by
``swarm-node audit --training``, ``node.audit_training``).

Decisions this module owns:

- **Order of checks** (``StepAuditor.audit``), cheapest first, each a ``Finding`` with the
  dispute reason of ``swarm.messages.training``: the record's numbers against the genesis
  (``wrong-params``); its window (``outside-window``); each cited verdict, fetched by the
  evidence protocol, must be a genesis validator's acceptance of a submission of this run made
  by the version the record says, inside the window (``unknown-verdict``, ``not-accepted``,
  ``outside-window``). Only a record that passes is replayed: the state before, fetched from
  the trainer (``/train-state/1``) and checked against ``state_before`` (``state-mismatch``);
  the groups rebuilt from the cited work exactly as the trainer built them
  (``node.roles.trainer_records.groups_of``); the published weights of the older versions the
  samples came from, and of the version itself, by SHARDCAST. The replay must give
  ``state_after`` (``replay-mismatch``) and the served weights must be ``weights`` and the
  published file (``weights-mismatch``).
- **Bits, then tolerance.** On the same kind of machine the replay gives the same bits
  (``agreed``). When it does not (other hardware), the trainer's own state after the step is
  fetched too (it must match ``state_after``) and the step agrees when the update's relative
  error (``node.compute.train_state.update_error``) is at most ``UPDATE_TOLERANCE``
  (``agreed-within-tolerance``); docs/RELIABILITY.md states the measured honest spread.
- **Several trainers** (``_audit_round``): the record carries every member's signed
  ``GradientCommitment`` (``members_of`` checks them); each member's gradient is fetched from it
  and matched to its commitment, the averaging and the publisher's optimizer step are replayed
  from them (within ``UPDATE_TOLERANCE``: hivemind's all-reduce sums in its own order), and the
  gradient of one member (``pick``: the validator's draw) or of every member (the CLI) is
  replayed from its samples and its own state before (bits, else the tolerance of its norm).
- **What is not replayed** says so (``not-replayed`` with why): a rollback (no step), a round's
  copy a member republished under another number, a sharded trainer's step (no commitments),
  a version never announced.
- **Coverage** (``coverage``, ``skipped``): from the trainer's signed receipts. Samples are
  trained oldest first inside the window, so a receipted sample of the window that a record
  passes over while it cites a later one (a larger ``seq``) was skipped (``skipped-sample``);
  receipted samples that left the window uncited are counted per worker.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import trio

from node.compute.train_child import ReplayChild
from node.model import model_info
from node.roles.evidence import NOT_HELD, EvidenceService, Lookup
from node.roles.trainer_records import STATE_CHUNK, STATE_LIMITS, groups_of, step_config
from node.run import TaskSource
from node.runtime import Node
from swarm.errors import MalformedError, NetworkError, PeerError, RequestTimeout, SwarmError
from swarm.messages import (
    GradientCommitment,
    RolloutSubmission,
    RunGenesis,
    SampleReceipt,
    Signed,
    TrainingRecord,
    Verdict,
    decode,
)
from swarm.net.names import TRAIN_STATE

log = logging.getLogger(__name__)

UPDATE_TOLERANCE = 1e-3
"""The largest relative error of an update (``update_error``) accepted when a replay is not
bit for bit (other hardware). Measured here: a replay on another thread count (2 for the
trainer's 1) gives the same bits on the embedded model and on a 512-wide one (error 0,
bench/train_audit.py), a tenfold learning rate is 9 updates away; no other CPU or GPU was at
hand, so the bound is a stated margin (float32 reduction orders move a sum by about 1e-7
relative), not a measured spread (docs/RELIABILITY.md, "Training audit")."""

ASK_TRIES = 3
"""Rounds of asking the holders that gave no answer for a cited object (1 s, then 2 s apart)
before the audit says it could not check it."""

GRPO_NUMBERS = (
    "learning_rate",
    "clip_epsilon",
    "clip_delta",
    "entropy_coef",
    "kl_coef",
    "max_grad_norm",
    "max_tokens",
)
"""The record's numbers that configure the replayed GRPO step."""

EXTRA_NUMBERS = ("rollback_to", "republished_from", "members_uncommitted")
"""Numbers a record may add to the genesis's: they say why a step is not replayed."""

STATE_TRIES = 4
"""State requests tried per chunk before the trainer counts as unreachable (no dispute)."""

Weights = Callable[[int], Awaitable[Path | None]]
"""``weights(version)``: the path of a published version's weights (fetched if need be)."""


@dataclass
class Finding:
    reason: str
    detail: str
    related: tuple[bytes, ...] = ()


@dataclass
class StepAudit:
    version: int
    outcome: str
    """``agreed``, ``agreed-within-tolerance``, ``disputed`` or ``not-replayed``."""
    detail: str = ""
    findings: list[Finding] = field(default_factory=list)
    again: bool = False
    """Not replayed for a reason that may pass (a peer that gave no answer, weights not
    fetched yet): worth another try later (``TrainingAudits``)."""
    update_error: float | None = None
    fetched_bytes: int = 0
    replay_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["findings"] = [
            {"reason": f.reason, "detail": f.detail, "related": [r.hex() for r in f.related]}
            for f in self.findings
        ]
        return out


class StepAuditor:
    """Audits records of one run (see the module docstring); one replay child, started on the
    first replay and kept."""

    def __init__(
        self,
        node: Node,
        evidence: EvidenceService,
        suite: TaskSource,
        model_dir: Path,
        work: Path,
        weights: Weights,
        *,
        chat_template: bool,
    ) -> None:
        self.node = node
        self.genesis: Signed[RunGenesis] = node.config.genesis
        self.params = self.genesis.message.params
        self.evidence = evidence
        self.suite = suite
        self.model_dir = model_dir
        self.work = work
        self.weights = weights
        self.chat_template = chat_template
        self.child: ReplayChild | None = None
        work.mkdir(parents=True, exist_ok=True)

    def close(self) -> None:
        if self.child is not None:
            self.child.close()
            self.child = None

    # -- the checks before any replay -----------------------------------------------------------

    def check_numbers(self, record: TrainingRecord) -> list[Finding]:
        try:
            numbers = json.loads(record.config)
        except ValueError as exc:
            return [Finding("wrong-params", f"the record's config is not JSON: {exc}")]
        if not isinstance(numbers, dict):
            return [Finding("wrong-params", "the record's config is not a map")]
        state = {"threads": numbers.get("threads"), "deterministic": numbers.get("deterministic")}
        extra = {k: v for k, v in numbers.items() if k in EXTRA_NUMBERS}
        expected = json.loads(step_config(self.params, state, **extra))
        wrong = sorted(k for k in set(expected) | set(numbers) if expected.get(k) != numbers.get(k))
        out = []
        if wrong:
            out.append(
                Finding(
                    "wrong-params",
                    "the record's "
                    + ", ".join(
                        f"{k}={numbers.get(k)!r} (genesis {expected.get(k)!r})" for k in wrong
                    ),
                )
            )
        floor = max(0, record.parent - self.params.async_level)
        # A rollback is no step: it cites nothing, and its trainer signs it with the window of
        # the step that collapsed, whose parent is one lower (``Trainer``): judged by its own
        # parent, an honest rollback was "outside-window" (a CI run's role-healing test).
        rollback = numbers.get("rollback_to") is not None and not record.verdicts
        if record.min_version < floor and not rollback:
            out.append(
                Finding(
                    "outside-window",
                    f"the step's window starts at v{record.min_version}, below v{floor}"
                    f" (async level {self.params.async_level})",
                )
            )
        return out

    async def cited_work(
        self, record: Signed[TrainingRecord]
    ) -> tuple[list[tuple[Signed[RolloutSubmission], Signed[Verdict]]], list[Finding], list[str]]:
        """The cited (submission, verdict) pairs, each checked; findings for those that fail;
        and why a cited object could not be checked (a holder gave no answer, asked
        ``ASK_TRIES`` times; or a verdict's submission nobody serves). A verdict is
        ``unknown-verdict`` only when every genesis validator answered that it does not hold
        it: silence is no evidence."""
        r = record.message
        g = self.genesis.message
        pairs: list[tuple[Signed[RolloutSubmission], Signed[Verdict]]] = []
        findings: list[Finding] = []
        unchecked: list[str] = []
        validators = [p for p in g.validators if p != self.node.peer_id]
        for verdict_id, sample_version in zip(r.verdicts, r.sample_versions, strict=True):
            short = verdict_id.hex()[:16]
            found = await self.evidence.lookup(
                verdict_id, validators, tries=ASK_TRIES, retry=validators
            )
            verdict = found.signed
            if verdict is None or not isinstance(verdict.message, Verdict):
                silent = [p for p in validators if p not in found.denied]
                if verdict is None and silent:
                    unchecked.append(_unanswered(f"cited verdict {short}", silent, found))
                    continue
                findings.append(
                    Finding(
                        "unknown-verdict",
                        f"cited verdict {short} is held by no validator reached",
                        (verdict_id,),
                    )
                )
                continue
            v = verdict.message
            if verdict.signer not in g.validators or not v.accepted or v.run_id != r.run_id:
                why = "is not an acceptance" if not v.accepted else "is not this run's"
                if verdict.signer not in g.validators:
                    why = f"is signed by {verdict.signer[-8:]}, no genesis validator"
                findings.append(
                    Finding("not-accepted", f"cited verdict {short} {why}", (verdict_id,))
                )
                continue
            found = await self.evidence.lookup(
                v.submission_id, [verdict.signer], tries=ASK_TRIES, retry=[verdict.signer]
            )
            submission = found.signed
            if submission is None or not isinstance(submission.message, RolloutSubmission):
                # A genesis validator's acceptance is the trainer's licence to train on the
                # work: a submission its holders lost stops the replay, it convicts nobody.
                what = f"the submission of cited verdict {short}"
                unchecked.append(_unanswered(what, [verdict.signer], found))
                continue
            made_by = submission.message.policy_version
            if made_by != sample_version or not r.min_version <= made_by <= r.parent:
                findings.append(
                    Finding(
                        "outside-window",
                        f"cited verdict {short}: its sample was made by v{made_by} (record says"
                        f" v{sample_version}); the step's window is v{r.min_version}..v{r.parent}",
                        (verdict_id,),
                    )
                )
                continue
            pairs.append((submission, verdict))
        return pairs, findings, unchecked

    # -- fetching the state ---------------------------------------------------------------------

    async def fetch_state(
        self, trainer: str, version: int, gradient: bytes | None = None
    ) -> tuple[Path, int]:
        """The trainer's state file of ``version`` or, with ``gradient`` (a commitment's
        sha256), the gradient a group member committed for the round to ``version``; raises
        ``SwarmError``, e.g. a version past its retention window. Returns its path and size."""
        tail: list[Any] = [] if gradient is None else ["gradient", gradient]
        name = f"s{version}" if gradient is None else f"g{version}-{gradient.hex()[:16]}"
        path = self.work / f"{name}-{trainer[-12:]}.safetensors"
        tmp = path.with_name(path.name + ".part")
        offset, size = 0, None
        with tmp.open("wb") as f:
            while size is None or offset < size:
                ask = msgpack.packb([version, offset, STATE_CHUNK, *tail], use_bin_type=True)
                body = await self._ask(trainer, ask)
                try:
                    answer = msgpack.unpackb(body, raw=False)
                    size, data = int(answer["size"]), bytes(answer["data"])
                except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
                    raise MalformedError(f"trainer answered no state chunk: {exc}") from exc
                if not data and offset < size:
                    raise MalformedError(f"trainer sent no bytes at offset {offset} of {size}")
                f.write(data)
                offset += len(data)
        tmp.replace(path)
        return path, offset

    async def _ask(self, trainer: str, body: bytes) -> bytes:
        """One state request; a dropped connection or a timeout is tried again
        (``STATE_TRIES`` in all), a refusal is not."""
        for attempt in range(STATE_TRIES):
            try:
                return await self.node.request(trainer, TRAIN_STATE, body, STATE_LIMITS)
            except (NetworkError, RequestTimeout) as exc:
                if isinstance(exc, PeerError) or attempt == STATE_TRIES - 1:
                    raise
                log.info("trainer %s: state request failed (%s); again", trainer[-8:], exc)
                await self.node.forget_peer(trainer)
                await trio.sleep(1.0 + 2 * attempt)
        raise AssertionError("unreachable")

    # -- the audit ------------------------------------------------------------------------------

    async def audit(self, record: Signed[TrainingRecord], pick: float | None = None) -> StepAudit:
        """Audit one record. A round of several trainers replays the averaging and, with
        ``pick`` (a draw in [0, 1)), the gradient of the one member it picks; without it, of
        every member (``swarm-node audit --training``)."""
        r = record.message
        self._tidy(r.parent - self.params.async_level)
        out = StepAudit(r.version, "disputed")
        out.findings = self.check_numbers(r)
        numbers = json.loads(r.config) if not out.findings else {}
        if "rollback_to" in numbers:
            return self._not(out, f"a rollback to the weights of v{numbers['rollback_to']}")
        if "republished_from" in numbers:
            why = f"a round's copy of v{numbers['republished_from']} republished by a member"
            return self._not(out, why)
        if "members_uncommitted" in numbers:
            why = f"{numbers['members_uncommitted']} member(s) of the round committed no gradient"
            return self._not(out, why)
        if not r.state_before or not r.state_after:
            return self._not(out, "a sharded trainer's step (no state commitments)")
        members: list[Signed[GradientCommitment]] = []
        if r.members:
            members, bad = self.members_of(record)
            out.findings += bad
        # The weights first: a shard store keeps few versions, and the checks take a while.
        published = await self._copy_of(r.version)
        old: dict[str, str] = {}
        missing: list[int] = []
        for version in sorted(set(r.sample_versions) - {r.parent}):
            path = await self._copy_of(version)
            if path is None:
                missing.append(version)
            else:
                old[str(version)] = str(path)
        pairs, bad, unchecked = await self.cited_work(record)
        out.findings += bad
        if out.findings:
            return out
        if unchecked:
            more = f" (and {len(unchecked) - 1} more)" if len(unchecked) > 1 else ""
            return self._not(out, unchecked[0] + more, again=True)
        if published is None:
            why = f"the weights of v{r.version} were not fetched"
            if self.node.policy.accepted.get(r.version) is None:
                why += " (no announcement of it accepted here yet)"
            return self._not(out, why, again=True)
        if missing:
            why = f"the weights of v{missing} are held here no longer and were not fetched"
            return self._not(out, why, again=True)
        state = await self._state_or_finding(out, record.signer, r.parent)
        if state is None:
            return out
        groups = [g for s, v in pairs for g in groups_of(s, v, self.params.group_size, self.suite)]
        args = {
            "model_dir": str(self.model_dir),
            "chat_template": self.chat_template,
            "config": {k: numbers[k] for k in GRPO_NUMBERS},
            "serve_dtype": numbers["serve_dtype"],
            "pad_id": model_info(self.model_dir).pad_id,
            "threads": int(numbers["threads"]) or 1,
            "seed": r.seed,
            "parent": r.parent,
            "groups": [g.to_wire() for g in groups],
            "state": str(state),
            "old": old,
            "published": str(published),
        }
        if members:
            return await self._audit_round(record, out, members, pairs, args, pick)
        started = time.perf_counter()
        got = await self._replay(args)
        if got["before"] != r.state_before:
            out.findings.append(
                Finding("state-mismatch", f"the served state of v{r.parent} is not the record's")
            )
            return out
        if got["after"] != r.state_after:
            try:
                theirs, size = await self.fetch_state(record.signer, r.version)
            except SwarmError as exc:
                out.findings.append(Finding("replay-mismatch", f"replay differs; {exc}"))
                return out
            out.fetched_bytes += size
            got = await self._replay({**args, "after": str(theirs)})
            out.update_error = got["update_error"]
            if got["their_after"] != r.state_after:
                out.findings.append(
                    Finding(
                        "state-mismatch", f"the served state of v{r.version} is not the record's"
                    )
                )
            elif got["update_error"] > UPDATE_TOLERANCE:
                out.findings.append(
                    Finding(
                        "replay-mismatch",
                        f"the replayed step is {got['update_error']:.3g} of an update away from"
                        f" the record's (tolerance {UPDATE_TOLERANCE:g})",
                    )
                )
        out.replay_seconds = time.perf_counter() - started
        if got["published"] != r.weights or (
            got["after"] == r.state_after and got["weights"] != r.weights
        ):
            out.findings.append(
                Finding(
                    "weights-mismatch",
                    f"the published weights of v{r.version} are not the step's result served",
                )
            )
        if not out.findings:
            exact = got["after"] == r.state_after
            out.outcome = "agreed" if exact else "agreed-within-tolerance"
        return out

    async def _state_or_finding(
        self, out: StepAudit, trainer: str, version: int, gradient: bytes | None = None
    ) -> Path | None:
        """A state (or gradient) fetched for the audit ``out``; None when it could not be, with
        ``out`` saying why: not replayed (past the retention window, or unreachable), or a
        ``state-mismatch`` (a refusal inside the window: refusing is no way out of an audit)."""
        try:
            path, size = await self.fetch_state(trainer, version, gradient)
        except SwarmError as exc:
            what = "state" if gradient is None else "gradient"
            newest = self.node.policy.version or version
            if version <= newest - self.params.train_state_keep:
                self._not(out, f"past the retention window: {exc}")
            elif not isinstance(exc, PeerError):  # unreachable, not refusing: no dispute
                why = f"trainer {trainer[-8:]} did not answer for the {what}: {exc}"
                self._not(out, why, again=True)
            else:
                out.findings.append(
                    Finding("state-mismatch", f"{what} of v{version} not served: {exc}")
                )
            return None
        out.fetched_bytes += size
        return path

    def members_of(
        self, record: Signed[TrainingRecord]
    ) -> tuple[list[Signed[GradientCommitment]], list[Finding]]:
        """The members' gradient commitments a round's record carries, each checked: signed by
        a genesis trainer, once, for this run, version and seed; together they cite exactly
        the record's verdicts, member after member."""
        r = record.message
        out: list[Signed[GradientCommitment]] = []
        cited: list[tuple[bytes, int]] = []
        for index, raw in enumerate(r.members):
            try:
                c = decode(raw, GradientCommitment)
            except SwarmError as exc:
                return [], [Finding("member-mismatch", f"member commitment {index}: {exc}")]
            m = c.message
            who = c.signer[-8:]
            if c.signer not in self.genesis.message.trainers:
                why = f"is signed by {who}, no genesis trainer"
            elif any(c.signer == o.signer for o in out):
                why = f"repeats member {who}"
            elif (m.run_id, m.version, m.seed) != (r.run_id, r.version, r.seed):
                why = f"of {who} is for v{m.version} with seed {m.seed}, not this round's"
            else:
                out.append(c)
                cited += zip(m.verdicts, m.sample_versions, strict=True)
                continue
            return [], [Finding("member-mismatch", f"member commitment {index} {why}", (c.id,))]
        if cited != list(zip(r.verdicts, r.sample_versions, strict=True)):
            return [], [
                Finding("member-mismatch", "the members' citations are not the record's verdicts")
            ]
        return out, []

    async def _audit_round(
        self,
        record: Signed[TrainingRecord],
        out: StepAudit,
        members: list[Signed[GradientCommitment]],
        pairs: list[tuple[Signed[RolloutSubmission], Signed[Verdict]]],
        args: dict[str, Any],
        pick: float | None,
    ) -> StepAudit:
        """A round of several trainers: the averaging replayed from every member's committed
        gradient (checked against its commitment) must give the publisher's state after within
        ``UPDATE_TOLERANCE`` (hivemind's all-reduce sums in another order than a replay), and
        the picked members' gradients must replay from their samples."""
        r = record.message
        started = time.perf_counter()
        grads: list[Path] = []
        for c in members:
            path = await self._state_or_finding(out, c.signer, r.version, c.message.gradient)
            if path is None:
                return out
            grads.append(path)
        after = await self._state_or_finding(out, record.signer, r.version)
        if after is None:
            return out
        got = await self._call(
            "average",
            {
                **args,
                "members": [
                    {"path": str(p), "samples": c.message.samples}
                    for p, c in zip(grads, members, strict=True)
                ],
                "after": str(after),
            },
        )
        out.update_error = got["update_error"]
        for digest, c in zip(got["gradients"], members, strict=True):
            if digest != c.message.gradient:
                out.findings.append(
                    Finding(
                        "member-mismatch",
                        f"member {c.signer[-8:]} served a gradient that is not its commitment",
                        (c.id,),
                    )
                )
        if got["before"] != r.state_before or got["their_after"] != r.state_after:
            out.findings.append(
                Finding(
                    "state-mismatch",
                    f"the served states of v{r.parent}..v{r.version} are not the record's",
                )
            )
        elif got["update_error"] > UPDATE_TOLERANCE:
            out.findings.append(
                Finding(
                    "replay-mismatch",
                    f"the members' averaged gradient steps {got['update_error']:.3g} of an"
                    f" update away from the record's state (tolerance {UPDATE_TOLERANCE:g})",
                )
            )
        if got["published"] != r.weights or got["their_weights"] != r.weights:
            out.findings.append(
                Finding(
                    "weights-mismatch",
                    f"the published weights of v{r.version} are not the step's result served",
                )
            )
        if out.findings:
            return out
        exact = True
        rows = 0
        for index, c in enumerate(members):
            m = c.message
            mine, rows = pairs[rows : rows + len(m.verdicts)], rows + len(m.verdicts)
            if pick is not None and index != min(int(pick * len(members)), len(members) - 1):
                continue
            state = await self._state_or_finding(out, c.signer, r.parent)
            if state is None:
                return out
            groups = [
                g for s, v in mine for g in groups_of(s, v, self.params.group_size, self.suite)
            ]
            theirs = grads[index]
            replayed = await self._call(
                "gradient",
                {
                    **args,
                    "groups": [g.to_wire() for g in groups],
                    "state": str(state),
                    "seed": m.seed,
                    "threads": m.threads or 1,
                    "theirs": str(theirs),
                },
            )
            who = c.signer[-8:]
            if replayed["before"] != m.state_before:
                out.findings.append(
                    Finding(
                        "state-mismatch",
                        f"member {who}'s served state of v{r.parent} is not its commitment",
                        (c.id,),
                    )
                )
            elif replayed["gradient"] != m.gradient:
                exact = False
                if replayed["error"] > UPDATE_TOLERANCE:
                    out.findings.append(
                        Finding(
                            "member-mismatch",
                            f"member {who}'s gradient does not replay from its samples: it is"
                            f" {replayed['error']:.3g} of its norm away (tolerance"
                            f" {UPDATE_TOLERANCE:g})",
                            (c.id,),
                        )
                    )
        out.replay_seconds = time.perf_counter() - started
        if not out.findings:
            out.outcome = "agreed" if exact else "agreed-within-tolerance"
        return out

    def _tidy(self, oldest: int) -> None:
        """Drop the copies and states of versions below ``oldest`` (no later audit needs them)."""
        for path in self.work.iterdir():
            name = path.name.split(".")[0].split("-")[0]
            if name[:1] in "vsg" and name[1:].isdigit() and int(name[1:]) < oldest:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)

    async def _copy_of(self, version: int) -> Path | None:
        """A copy of ``version``'s published weights in the work folder: the shard store may
        drop its file (retention, a patch's reconstruction) while the replay reads it."""
        copy = self.work / f"v{version}"
        if copy.exists():
            return copy
        for _ in range(2):
            path = await self.weights(version)
            if path is None:
                return None
            try:
                await trio.to_thread.run_sync(_copy, path, copy)
                return copy
            except FileNotFoundError:
                continue  # dropped meanwhile: fetched again
        return None

    @staticmethod
    def _not(out: StepAudit, why: str, *, again: bool = False) -> StepAudit:
        if not out.findings:
            out.outcome, out.detail, out.again = "not-replayed", why, again
        return out

    async def _replay(self, args: dict[str, Any]) -> dict[str, Any]:
        return await self._call("replay", args)

    async def _call(self, op: str, args: dict[str, Any]) -> dict[str, Any]:
        """One request to the replay child (``replay``, ``gradient`` or ``average``)."""
        if self.child is None:
            self.child = await trio.to_thread.run_sync(ReplayChild)
        child = self.child
        result: dict[str, Any] = await trio.to_thread.run_sync(getattr(child, op), args)
        return result


def _copy(path: Path, dest: Path) -> None:
    tmp = dest.with_name(dest.name + ".tmp")
    if path.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(path, tmp)
    else:
        shutil.copyfile(path, tmp)
    tmp.replace(dest)


# -- coverage, from the trainer's signed receipts ---------------------------------------------


def skipped(
    record: Signed[TrainingRecord],
    receipts: Iterable[Signed[SampleReceipt]],
    trained: set[bytes],
) -> list[Signed[SampleReceipt]]:
    """Receipts of ``record``'s trainer for samples inside its window that it passed over while
    it cited a later one (``trained``: verdict ids cited by every record up to this one)."""
    r = record.message
    mine = [x for x in receipts if x.signer == record.signer and x.message.queued]
    cited = set(r.verdicts)
    seqs = [x.message.seq for x in mine if x.message.verdict_id in cited]
    if not seqs:
        return []
    last = max(seqs)
    return [
        x
        for x in mine
        if x.message.seq < last
        and r.min_version <= x.message.sample_version <= r.parent
        and x.message.verdict_id not in trained
    ]


def coverage(
    records: Sequence[Signed[TrainingRecord]],
    receipts: Sequence[Signed[SampleReceipt]],
    async_level: int,
) -> dict[str, dict[str, int]]:
    """Per worker: receipted samples, those cited by a record, and those that left the window
    (``sample_version < newest - async_level``) uncited."""
    cited = {v for rec in records for v in rec.message.verdicts}
    newest = max((rec.message.version for rec in records), default=0)
    out: dict[str, dict[str, int]] = {}
    for x in receipts:
        m = x.message
        if not m.queued:
            continue
        row = out.setdefault(m.worker, {"handed": 0, "trained": 0, "left_out": 0})
        row["handed"] += 1
        if m.verdict_id in cited:
            row["trained"] += 1
        elif m.sample_version < newest - async_level:
            row["left_out"] += 1
    return out


def decode_receipts(raws: Iterable[Any]) -> list[Signed[SampleReceipt]]:
    out = []
    for raw in raws:
        if isinstance(raw, bytes):
            try:
                out.append(decode(raw, SampleReceipt))
            except SwarmError:
                continue
    return out


def _unanswered(what: str, asked: Sequence[str], found: Lookup) -> str:
    """Why ``what`` could not be checked: each holder's answer, or why it gave none."""

    def answer(peer: str) -> str:
        return NOT_HELD if peer in found.denied else found.silent.get(peer, "not asked")[:120]

    whys = "; ".join(f"{p[-8:]}: {answer(p)}" for p in asked)
    return f"{what} was not served ({whys})"
