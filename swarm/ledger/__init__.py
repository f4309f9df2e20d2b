"""The run's ledger: a grow-only set of signed events and the deterministic balances it implies.

``rules`` says who may sign what for how much; ``fold`` turns any set of checked events into
balances (order and duplicates do not matter, so replicas converge by exchanging missing
events); ``store`` keeps the set in SQLite with balances kept incrementally; ``reconcile`` holds
the range fingerprints that ledger sync compares.

The contract (what validators sign, what every replica checks; docs/protocol.md has the wire):

1. **An event cites its verdict.** A credit, slash or dispute carries the id of a Verdict signed
   by the same validator in ``evidence`` (``LedgerEvent`` documents each field per event type).
   The rules check the event against that verdict: signer, worker (``peer``), accepted or hard,
   and the amount (credit = ``credit_per_sample`` x the verdict's accepted samples, slash =
   ``slash_amount``, dispute = 0). Grants (run owner) cite nothing.
2. **The verdict travels first.** A validator stores and gossips the Verdict before its events
   (``LedgerStore.add(events, verdicts=[verdict])`` stores both in one transaction). Ledger sync
   answers every event with the verdicts it cites. A replica that receives an event whose verdict
   it does not hold keeps it *pending* (not in the set, counted for nothing, not offered to
   sync) and adds it when the verdict arrives; an event that breaks a rule is refused with the
   reason (``ValidationError``), and the replica logs it and counts it in ``status``.
3. **One assignment, one credit, one slash.** The fold counts at most one credit and one slash
   per assignment (worker, policy version, request counter, read from the verdict), whichever
   validator judged it: the event with the smallest id. An equivocation (two different signed
   submissions for one assignment) is slashed by a hard Verdict whose reasons include
   ``rules.EQUIVOCATION``, judging one submission, with the slash's ``related`` = (the other
   submission's id,); it is the assignment's one slash.
4. **Disputes.** A validator that re-judges another validator's accepted work and rejects it
   signs its own rejecting Verdict for the same submission and a ``dispute`` event: ``evidence``
   = its verdict, ``related`` = (the disputed verdict,), ``peer`` = the disputed validator,
   ``amount`` = 0. The fold moves no balance for a dispute (the disputed credit keeps counting);
   ``ledger show``, ``status`` and ``audit`` list it, and the audit settles it by replaying the
   submission.
"""

from swarm.ledger.fold import Balances, fold, winners
from swarm.ledger.rules import EQUIVOCATION, Entry, VerdictFacts, check_event, check_verdict
from swarm.ledger.store import LedgerStore
from swarm.ledger.views import EventRow

__all__ = [
    "EQUIVOCATION",
    "Balances",
    "Entry",
    "EventRow",
    "LedgerStore",
    "VerdictFacts",
    "check_event",
    "check_verdict",
    "fold",
    "winners",
]
