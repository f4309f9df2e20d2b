"""``swarm-node up``: a whole local swarm as separate processes on 127.0.0.1.

A bootstrap peer, a trainer, a validator, N honest inference workers and (by default) one
cheating worker, each a ``swarm-node`` process with a fresh home under ``OUT/homes``, joined to a
genesis made for the embedded default model. ``LocalSwarm`` starts them, reads their admin
sockets for the live view, stops them all (SIGINT, then SIGKILL after a grace period), and then
the audit runs on the validator's ledger. Everything lands in ``OUT``: ``summary.json``, the
reward curve, the ledger and every process's log. The bootstrap peer serves the run's web
dashboard (``--http``, 127.0.0.1 and a free port by default); ``dashboard_url`` is its address.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from node import admin
from node.home import NodeConfig, NodeHome
from node.run import create_genesis, write_genesis
from swarm.errors import ConfigError, NetworkError, StorageError, SwarmError
from swarm.ledger.evaluations import EvaluationStore, read_curve, summarize
from swarm.messages import RunParams, run_id_of

log = logging.getLogger(__name__)

DEMO_PARAMS = RunParams(
    group_size=8,
    batch_prompts=16,
    max_tokens=12,
    learning_rate=2e-4,
    max_grad_norm=0.1,
    async_level=2,
    submissions_per_step=1,
    toploc_max_submission_mant_mean=1.2,
    # Versions are served in bf16 (the trainer keeps float32 masters): in-process GRPO with these
    # parameters learned the same with either (mean batch reward of versions 250-299, two runs:
    # bf16 0.696, fp32 0.702; held-out sampled at v300: 0.678 / 0.690; docs/BENCHMARKS.md,
    # "Serving dtype").
    serve_dtype="bfloat16",
    # Held-out evaluation every 4 versions (the run default is 10): 51 points over the demo's
    # 200 versions, 6 over the 20 of a short `up` (one batch of 32 items each, ~0.1 s on the
    # embedded model), so the summary's eval_gain reads on a curve.
    eval_every=4,
)
"""The demo run's parameters (see docs/BENCHMARKS.md, in-process GRPO, for how they were set)."""

AUDIT_CREDITS = 30
"""Credits replayed at the end of `up` (a random sample; every slash is replayed). A full replay
of a 10-minute run's credits takes minutes; `swarm-node audit OUT/ledger.db` does it."""

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Children get SIGTERM if ``up`` itself dies (kill -9 included): no orphaned swarm. And
    SIGINT stops them (``stop``) even when ``up`` was started with it ignored, as a shell
    starts a script's background jobs: an ignored signal stays ignored across exec, and the
    children of such an ``up`` ran on through its SIGINT until their SIGKILL (their databases
    never checkpointed)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def copy_database(source: Path, dest: Path) -> None:
    """Copy a node's SQLite file with what its write-ahead log holds (SQLite's backup API). A
    file copy takes the main file alone: the stores run in WAL mode, and a node stopped by
    SIGKILL (past ``LocalSwarm.stop``'s grace) had checkpointed nothing, so the copied ledger held
    no table and the audit failed ("no such table")."""
    dest.unlink(missing_ok=True)
    reading = f"{source.resolve().as_uri()}?mode=ro"
    try:
        with (
            contextlib.closing(sqlite3.connect(reading, uri=True)) as src,
            contextlib.closing(sqlite3.connect(dest)) as into,
        ):
            src.backup(into)
    except sqlite3.DatabaseError as exc:
        raise StorageError(f"cannot copy {source} to {dest}: {exc}") from exc


@dataclass
class Proc:
    name: str
    role: str
    home: Path
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    args: list[str] = field(default_factory=list)
    peer_id: str = ""
    status: dict[str, Any] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None


@dataclass
class UpConfig:
    out: Path
    workers: int = 2
    versions: int = 20
    minutes: float = 10.0
    with_cheater: bool = True
    cheat: str = "edit-token"
    params: RunParams = DEMO_PARAMS
    http: str | None = "127.0.0.1:0"
    """Where the bootstrap peer serves the dashboard (None: no dashboard)."""
    trainers: int = 1
    """Trainer processes (named trainer, trainer-2, ...); more than one average through hivemind."""
    trainer_args: tuple[str, ...] = ()
    """Extra ``join`` arguments for the trainers (e.g. ``--nproc 2``)."""


def _evaluation_facts(curve: list[dict[str, Any]]) -> dict[str, Any]:
    """The held-out evaluation of the run: its curve (version, mean), and the gain of the last
    evaluated version over the first (``eval_gain``; None with fewer than two points)."""
    facts = summarize(curve)
    return {
        "evaluation": [{"version": p["version"], "mean": p["mean"]} for p in curve],
        "eval_gain": facts["gain"],
        "eval_first": facts["first_mean"],
        "eval_last": facts["latest_mean"],
    }


def _gains(rewards: list[float], window: int = 5) -> dict[str, float | None]:
    """One version's mean reward is noisy (16 prompts): report the gain of the last version over
    version 0 as asked, and the gain of the trailing mean over the leading one."""
    if len(rewards) < 2:
        return {"reward_gain": None, "reward_gain_smoothed": None}
    k = min(window, len(rewards) // 2)
    lead, trail = rewards[:k], rewards[-k:]
    return {
        "reward_gain": rewards[-1] - rewards[0],
        "reward_gain_smoothed": sum(trail) / k - sum(lead) / k,
    }


class LocalSwarm:
    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.out = config.out
        self.procs: list[Proc] = []
        self.genesis_path = self.out / "run.genesis"
        self.started = time.monotonic()
        self.run_id = ""
        self.dashboard_url: str | None = None

    # -- set-up ---------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Homes, keys and the genesis. Refuses an ``--out`` that already holds a run."""
        if self.out.exists() and any(self.out.iterdir()):
            raise ConfigError(
                f"{self.out} is not empty (a previous `up`?); choose another --out or remove it"
            )
        (self.out / "logs").mkdir(parents=True, exist_ok=True)
        homes = self.out / "homes"
        names = [("bootstrap", "bootstrap"), ("trainer", "trainer")]
        names += [(f"trainer-{i}", "trainer") for i in range(2, self.config.trainers + 1)]
        names.append(("validator", "validator"))
        names += [(f"worker-{i}", "inference") for i in range(self.config.workers)]
        if self.config.with_cheater:
            names.append(("cheater", "inference"))
        owner, _ = NodeHome(homes / "owner").create()
        for name, role in names:
            home = NodeHome(homes / name)
            key, _ = home.create()
            home.save_config(NodeConfig(listen=("/ip4/127.0.0.1/tcp/0",)))
            proc = Proc(
                name, role, home.path, self.out / "logs" / f"{name}.log", peer_id=key.peer_id
            )
            self.procs.append(proc)
        genesis = create_genesis(
            owner,
            name="local demo",
            trainers=[p.peer_id for p in self.procs if p.role == "trainer"],
            validators=[self.proc("validator").peer_id],
            params=self.config.params,
        )
        write_genesis(genesis, self.genesis_path)
        self.run_id = run_id_of(genesis)

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def _spawn(self, proc: Proc, args: list[str]) -> None:
        proc.args = args
        env = os.environ | {"SWARM_NODE_HOME": str(proc.home), "PYTHONUNBUFFERED": "1"}
        env.pop("SWARM_NODE_PASSPHRASE", None)
        with proc.log_path.open("ab") as log_file:
            proc.popen = subprocess.Popen(
                [sys.executable, "-m", "cli.app", *args, "--home", str(proc.home)],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # our Ctrl-C is ours to forward, in order
                preexec_fn=_die_with_parent,
            )

    async def start(self) -> None:
        boot = self.proc("bootstrap")
        args = ["bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0"]
        if self.config.http is not None:
            args += ["--run", str(self.genesis_path), "--http", self.config.http]
        self._spawn(boot, args)
        address = await self._bootstrap_address(boot)
        if self.config.http is not None:
            line = await self._line(boot, lambda text: text.startswith("dashboard http"))
            self.dashboard_url = line.split()[1]
        for proc in self.procs:
            if proc is boot:
                continue
            args = ["join", "--role", proc.role, "--run", str(self.genesis_path)]
            args += ["--bootstrap", address]
            if proc.name == "cheater":
                args += ["--cheat", self.config.cheat]
            if proc.role == "trainer":
                args += self.config.trainer_args
            self._spawn(proc, args)

    async def _bootstrap_address(self, boot: Proc, timeout: float = 60.0) -> str:
        return await self._line(
            boot, lambda text: text.startswith("/ip4/127.0.0.1/") and "/p2p/" in text, timeout
        )

    async def _line(self, proc: Proc, wanted: Callable[[str], bool], timeout: float = 60.0) -> str:
        """The first line of ``proc``'s log that is ``wanted`` (stripped)."""
        with trio.move_on_after(timeout):
            while True:
                for line in proc.log_path.read_text(errors="replace").splitlines():
                    if wanted(line):
                        return line.strip()
                if not proc.alive:
                    break
                await trio.sleep(0.1)
        raise NetworkError(f"the {proc.name} process did not start; see {proc.log_path}")

    def kill(self, name: str) -> None:
        """SIGKILL one process (fault tests)."""
        proc = self.proc(name)
        if proc.popen is not None and proc.alive:
            proc.popen.kill()
            proc.popen.wait()

    def respawn(self, name: str) -> None:
        """Start a process again with the same home and arguments (after ``kill``)."""
        proc = self.proc(name)
        self._spawn(proc, proc.args)

    # -- while it runs -------------------------------------------------------------------------

    async def poll(self) -> None:
        """Refresh every process's status from its admin socket (missing ones stay as they were)."""
        for proc in self.procs:
            if not proc.alive:
                continue
            try:
                answer = await admin.query(admin.socket_path(proc.home), {"cmd": "status"}, 2.0)
            except (SwarmError, OSError, trio.BrokenResourceError):
                continue  # it is stopping (or was just killed)
            proc.status = answer.get("status", {})

    def trainer_status(self) -> dict[str, Any]:
        return dict(self.proc("trainer").status.get("role_status", {}).get("trainer", {}))

    def reward_by_version(self) -> list[tuple[int, float]]:
        rewards = self.trainer_status().get("reward_by_version", {})
        return sorted((int(v), float(r)) for v, r in rewards.items())

    def version(self) -> int:
        """The newest version any live trainer reports."""
        return max(
            (
                int(p.status.get("role_status", {}).get("trainer", {}).get("version", 0))
                for p in self.procs
                if p.role == "trainer" and p.alive
            ),
            default=0,
        )

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def cheater_judged(self) -> bool:
        """Whether the cheater (if any) has had a submission judged. The demo is there to show
        a cheater caught: with few versions a slow start could stop the run before its first
        verdict, so reaching the version target waits for it (the time limit still holds)."""
        for proc in self.procs:
            if proc.name == "cheater":
                worker = proc.status.get("role_status", {}).get("worker", {})
                if int(worker.get("submitted", 0)) < 1:
                    return False
        return True

    def finished(self) -> str | None:
        if self.version() >= self.config.versions and self.cheater_judged():
            return f"reached {self.config.versions} versions"
        if self.elapsed() >= self.config.minutes * 60:
            return f"time limit of {self.config.minutes:g} minutes"
        dead = [p.name for p in self.procs if p.popen is not None and not p.alive]
        if dead:
            return f"process(es) exited: {', '.join(dead)} (see {self.out / 'logs'})"
        return None

    # -- shutdown and results ------------------------------------------------------------------

    def stop(self, grace: float = 15.0) -> None:
        """SIGINT every process (workers first, bootstrap last), then SIGKILL what remains."""
        order = [p for p in reversed(self.procs) if p.alive]
        for proc in order:
            assert proc.popen is not None
            proc.popen.send_signal(signal.SIGINT)
        deadline = time.monotonic() + grace
        for proc in order:
            assert proc.popen is not None
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s of SIGINT: killed", proc.name, grace)
                proc.popen.kill()
                proc.popen.wait()

    def validator_ledger(self) -> Path:
        return self.proc("validator").home / "runs" / self.run_id / "ledger.db"

    def _policy_bytes(self) -> dict[str, Any]:
        """Bytes per version as published (a patch against the full size) and bytes saved."""
        from node.shardcast import version_costs
        from swarm.shardcast import ShardStore

        shards = self.proc("trainer").home / "runs" / self.run_id / "shards"
        if not shards.is_dir():
            return {}
        try:
            return version_costs(ShardStore(shards, keep=1 << 30))
        except SwarmError as exc:
            return {"error": str(exc)}

    def summarise(self, reason: str) -> dict[str, Any]:
        """Copy the ledger, audit it, and write ``summary.json`` (partial on an early stop)."""
        summary: dict[str, Any] = {
            "stopped_because": reason,
            "wall_s": round(self.elapsed(), 1),
            "run_id": self.run_id,
            "reward_by_version": [r for _, r in self.reward_by_version()],
            **_gains([r for _, r in self.reward_by_version()]),
            "versions": [v for v, _ in self.reward_by_version()],
            "cheaters": [p.peer_id for p in self.procs if p.name == "cheater"],
            "honest_workers": [p.peer_id for p in self.procs if p.name.startswith("worker-")],
        }
        from node.audit import audit_ledger, policy_dir_source  # loads torch: only at the end
        from node.audit_weights import checked_source, store_manifests

        ledger = self.validator_ledger()
        if ledger.exists():
            copy_database(ledger, self.out / "ledger.db")
            evidence = ledger.with_name("evidence.db")  # what the audit replays (by id)
            if evidence.exists():
                copy_database(evidence, self.out / "evidence.db")
            evaluations = ledger.with_name(EvaluationStore.FILE)  # the held-out curve
            if evaluations.exists():
                copy_database(evaluations, self.out / EvaluationStore.FILE)
            summary |= _evaluation_facts(read_curve(self.out / "ledger.db"))
            summary |= self._ledger_facts(self.out / "ledger.db")
            summary["policy_bytes"] = self._policy_bytes()
            policies = self.proc("trainer").home / "runs" / self.run_id / "policies"
            try:
                rows = audit_ledger(
                    self.out / "ledger.db",
                    checked_source(
                        policy_dir_source(policies), store_manifests(policies.parent / "shards")
                    ),
                    credits=AUDIT_CREDITS,
                )
                summary["audit_ok"] = all(r.ok is not False for r in rows)
                summary["audit_unchecked"] = sum(r.ok is None for r in rows)
                summary["audit"] = [r.__dict__ for r in rows]
            except SwarmError as exc:
                summary["audit_ok"] = False
                summary["audit"] = [{"check": "audit", "ok": False, "detail": str(exc)}]
        else:
            summary["audit_ok"] = False
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        self._plot(summary)
        return summary

    def _ledger_facts(self, path: Path) -> dict[str, Any]:
        from swarm.ledger import LedgerStore
        from swarm.messages import Verdict, decode

        try:
            store = LedgerStore.open_existing(path)
        except StorageError as exc:
            return {"ledger_error": str(exc)}
        try:
            balances = store.balances()  # a live view of the store: read it before closing
            events = list(store.events())
            # Every verdict the validator signed is in the ledger (the evidence store keeps the
            # envelopes the audit replays, not a list of verdicts).
            verdicts = [decode(raw, Verdict) for raw in store.raw_verdicts()]
            return {
                "accepted": sum(1 for v in verdicts if v.message.accepted),
                "rejected": sum(1 for v in verdicts if not v.message.accepted),
                "slashed": sorted({e.message.peer for e in events if e.message.event == "slash"}),
                "banned": sorted(p for p in balances.by_peer if balances.banned(p)),
                "credited": sorted({e.message.peer for e in events if e.message.event == "credit"}),
                "balances": dict(balances.by_peer),
            }
        finally:
            store.close()

    def _plot(self, summary: dict[str, Any]) -> None:
        rewards = summary.get("reward_by_version") or []
        if not rewards:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(summary["versions"], rewards, marker="o", markersize=3, label="reward (accepted)")
        curve = summary.get("evaluation") or []
        if curve:
            ax.plot(
                [p["version"] for p in curve],
                [p["mean"] for p in curve],
                marker="s",
                color="#2b8a3e",
                label="held-out evaluation",
            )
            ax.legend(loc="lower right")
        ax.set_xlabel("policy version")
        ax.set_ylabel("mean reward of accepted samples")
        ax.set_title(f"swarm-node up: {len(rewards)} versions in {summary['wall_s']:.0f} s")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(self.out / "reward_curve.png", dpi=120)
        plt.close(fig)
