"""Adversaries for the tests, the benchmarks and the demo: dishonest workers, validators,
trainers and holders built by wrapping the real roles from outside.

Nothing in ``swarm``, ``node``, ``cli`` or ``bootstrap`` imports this package (the import
contract in ``pyproject.toml`` puts it above them all), so the roles a contributor runs carry
no cheating branch and ``swarm-node join`` has no switch that turns one on. An adversary edits
what a real role sends, or replaces one of its steps, in its own process; docs/THREATS.md lists
every attack, the check that stops it and what it can still do.
"""
