"""The run's ledger: a grow-only set of signed events and the deterministic balances it implies.

``rules`` says who may sign what; ``fold`` turns any set of events into balances (order does not
matter, so replicas converge by exchanging missing events); ``store`` keeps the set in SQLite.
"""

from swarm.ledger.fold import Balances, fold
from swarm.ledger.rules import check_event, check_verdict
from swarm.ledger.store import LedgerStore

__all__ = ["Balances", "LedgerStore", "check_event", "check_verdict", "fold"]
