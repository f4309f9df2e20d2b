"""Run an engine in a child process so that the node's event loop never runs the model.

Channel: the child's stdin/stdout pipes carry frames of a 4-byte big-endian length followed by
msgpack (bounded to 256 MiB per frame). Arrays travel as ``{"nd": [dtype, shape, raw bytes]}``,
never pickle. The child's stderr goes to a log file whose tail is quoted when it dies.

Ops: ``init``, ``generate``, ``prefill_batch`` (tests and tools; it ships full logits),
``load_weights``, and the ones that keep the model's files in the child: ``encode_prompts``,
``decode``, ``score`` (tokenizer, chat template, verifiers) and ``verify`` (the validator's
sampling and TOPLOC checks, chunked next to the logits; only verdict numbers come back, see
:mod:`node.verify` for the memory bound).

Requests are ``{"op": ..., "args": {...}}``; replies ``{"ok": true, "result": ...}`` or
``{"ok": false, "error": "..."}`` (an error inside the child, the child stays up). A child that
exits, is killed or answers nonsense raises :class:`EngineError`; :meth:`ChildEngine.restart`
starts a fresh one with the same model (and the last weights loaded through it).

Threads: each call holds a lock for its request/response pair, so the engine may be used from
worker threads. From trio: ``await engine.agenerate(...)`` runs :meth:`generate` via
``trio.to_thread.run_sync``; cancelling the awaiting task does not interrupt the child (the
thread finishes the request, its result is dropped).
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO, Any

import msgpack
import numpy as np

from node.compute.engine import Engine, EngineInfo, Generation, Prefill, ScoreItem
from node.verify import (
    SampleClaim,
    SampleVerdict,
    VerifySettings,
    claim_from_wire,
    claim_to_wire,
    verdict_from_wire,
    verdict_to_wire,
)
from swarm.errors import EngineError, SwarmError
from swarm.sampling import GUMBEL_2

MAX_FRAME = 256 * 1024 * 1024
_ROOT = str(Path(__file__).resolve().parents[2])
PARENT_ENV = "SWARM_RANK_PARENT"
"""The pid of the training child that started a trainer's worker ranks (``node.compute.ranks``
sets it, ``node.compute.fsdp`` reads it): here, below both, so neither imports the other."""


# -- framing and array encoding ------------------------------------------------------------------


def _pack_nd(a: np.ndarray) -> dict[str, Any]:
    a = np.ascontiguousarray(a)
    return {"nd": [a.dtype.str, list(a.shape), a.tobytes()]}


def _unpack_nd(obj: Any) -> np.ndarray:
    try:
        dtype, shape, raw = obj["nd"]
        return np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape).copy()
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"engine child sent a malformed array: {exc}") from exc


def write_frame(stream: IO[bytes], obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    stream.write(struct.pack(">I", len(data)) + data)
    stream.flush()


def read_frame(stream: IO[bytes]) -> Any:
    """One frame, or None at a clean end of stream. Raises EngineError on a bad frame."""
    head = stream.read(4)
    if not head:
        return None
    if len(head) != 4:
        raise EngineError("engine channel closed in the middle of a frame header")
    (size,) = struct.unpack(">I", head)
    if size > MAX_FRAME:
        raise EngineError(f"engine frame of {size} bytes exceeds {MAX_FRAME}")
    data = stream.read(size)
    if len(data) != size:
        raise EngineError("engine channel closed in the middle of a frame")
    try:
        return msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise EngineError(f"engine frame is not msgpack: {exc}") from exc


def generation_to_wire(g: Generation) -> dict[str, Any]:
    return {"tokens": g.tokens, "finish": g.finish_reason, "hidden": _pack_nd(g.hidden)}


def generation_from_wire(obj: Any) -> Generation:
    try:
        finish = obj["finish"]
        if finish not in ("stop", "length"):
            raise ValueError(f"finish reason {finish!r}")
        return Generation([int(t) for t in obj["tokens"]], finish, _unpack_nd(obj["hidden"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(f"engine child sent a malformed generation: {exc}") from exc


def prefill_to_wire(p: Prefill) -> dict[str, Any]:
    return {"logits": _pack_nd(p.logits), "hidden": _pack_nd(p.hidden)}


def prefill_from_wire(obj: Any) -> Prefill:
    try:
        return Prefill(_unpack_nd(obj["logits"]), _unpack_nd(obj["hidden"]))
    except (KeyError, TypeError) as exc:
        raise EngineError(f"engine child sent a malformed prefill: {exc}") from exc


# -- the parent side -----------------------------------------------------------------------------


class FramedChild:
    """A ``python -m <module>`` child speaking the frame protocol above on its stdin/stdout.

    The child leads its own process group (``start_new_session``) and ends when its stdin closes
    (this process died); ``close`` kills the whole group, so helpers the child forked
    (hivemind's p2pd and averager) go with it. No ``PR_SET_PDEATHSIG`` here: children are
    started from worker threads, and the signal fires when the *thread* that forked ends.
    """

    module = "node.compute.child"
    what = "engine child"

    _proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None
    log_path: Path | None = None
    """Where the child's stderr goes (appended); a temporary file when None."""

    def _lock_init(self) -> None:
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _spawn(self) -> None:
        if self.log_path is not None:
            self._log = self.log_path.open("ab")
        else:
            self._log = tempfile.NamedTemporaryFile(prefix="swarm-child-", suffix=".log")  # noqa: SIM115
        env = dict(os.environ)
        env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
        self._proc = subprocess.Popen(
            [sys.executable, "-m", self.module],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=env,
            start_new_session=True,
        )

    def log_tail(self, chars: int = 2000) -> str:
        if self._log is None:
            return ""
        try:
            with Path(self._log.name).open("rb") as f:
                f.seek(max(0, Path(self._log.name).stat().st_size - chars))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def _died(self, what: str) -> EngineError:
        proc = self._proc
        code = proc.poll() if proc else None
        if proc and code is None:
            proc.kill()
            code = proc.wait()
        tail = self.log_tail()
        pid = proc.pid if proc else "?"
        msg = f"{self.what} (pid {pid}) {what}; exit code {code}; call restart() for a new one"
        return EngineError(msg + (f"\n--- child log ---\n{tail}" if tail else ""))

    def _call(self, op: str, args: dict[str, Any]) -> Any:
        with self._lock:
            proc = self._proc
            if proc is None or proc.stdin is None or proc.stdout is None:
                raise EngineError(f"{self.what} is closed; call restart() for a new one")
            if proc.poll() is not None:
                raise self._died("has exited")
            try:
                write_frame(proc.stdin, {"op": op, "args": args})
                reply = read_frame(proc.stdout)
            except (BrokenPipeError, OSError, ValueError) as exc:
                raise self._died(f"broke the channel ({exc})") from exc
            except EngineError as exc:
                raise self._died(str(exc)) from exc
            if reply is None:
                raise self._died("closed its output")
        if not isinstance(reply, dict) or "ok" not in reply:
            raise EngineError(f"{self.what} answered nonsense to {op!r}")
        if not reply["ok"]:
            raise EngineError(f"{self.what} failed {op!r}: {reply.get('error')}")
        return reply.get("result")

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
            if proc is not None:
                try:
                    if proc.poll() is None and proc.stdin is not None:
                        write_frame(proc.stdin, {"op": "close", "args": {}})
                        proc.stdin.close()
                    proc.wait(timeout=10)
                except (OSError, ValueError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait()
                with contextlib.suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)  # helpers it forked, if any are left
                if proc.stdout is not None:
                    proc.stdout.close()
            if self._log is not None:
                self._log.close()
                self._log = None


class ChildEngine(FramedChild, Engine):
    """The same interface as :class:`Engine`; the model lives in ``python -m node.compute.child``.

    ``kind`` is ``"torch"`` (or ``"vllm"`` on a GPU machine with the ``gpu`` extra).
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        kind: str = "torch",
        dtype: str = "float32",
        device: str = "cpu",
        threads: int | None = None,
        chat_template: bool = False,
    ) -> None:
        self._spec = {
            "kind": kind,
            "path": str(model_path),
            "dtype": dtype,
            "device": device,
            "threads": threads,
            "chat_template": chat_template,
        }
        self._lock_init()
        self._weights: str | None = None
        self._start()

    def _start(self) -> None:
        self._spawn()
        info = self._call("init", self._spec)
        info["eos_ids"] = tuple(info.get("eos_ids") or ())
        self.info = EngineInfo(**info)
        if self._weights is not None:
            self._call("load_weights", {"path": self._weights})

    def restart(self) -> None:
        """Stop the child (if alive) and start a fresh one with the same model and weights."""
        self.close()
        self._start()

    def generate(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        temperature: float,
        max_tokens: int,
        sample_indices: list[int] | None = None,
        *,
        sampler: str = GUMBEL_2,
    ) -> list[Generation]:
        args = {
            "prompts": prompts,
            "seeds": seeds,
            "temperature": float(temperature),
            "max_tokens": max_tokens,
            "sample_indices": sample_indices,
            "sampler": sampler,
        }
        result = self._call("generate", args)
        if not isinstance(result, list):
            raise EngineError("engine child answered generate with a non-list")
        return [generation_from_wire(g) for g in result]

    def prefill(self, prompt: list[int], tokens: list[int]) -> Prefill:
        return self.prefill_batch([(prompt, tokens)])[0]

    def prefill_batch(self, items: list[tuple[list[int], list[int]]]) -> list[Prefill]:
        result = self._call("prefill_batch", {"items": [[p, t] for p, t in items]})
        if not isinstance(result, list):
            raise EngineError("engine child answered prefill with a non-list")
        return [prefill_from_wire(p) for p in result]

    def load_weights(self, path: str) -> None:
        self._call("load_weights", {"path": str(path)})
        self._weights = str(path)

    def _list(self, op: str, args: dict[str, Any]) -> list[Any]:
        result = self._call(op, args)
        if not isinstance(result, list):
            raise EngineError(f"engine child answered {op} with a non-list")
        return result

    def encode_prompts(self, texts: list[str]) -> list[list[int]]:
        return [[int(t) for t in ids] for ids in self._list("encode_prompts", {"texts": texts})]

    def decode(self, tokens: list[int]) -> str:
        return str(self._call("decode", {"tokens": tokens}))

    def score(self, items: list[ScoreItem], length_coeff: float) -> list[float]:
        wire = [[it.tokens, it.answer, it.verifier, it.target_len, it.entry] for it in items]
        args = {"items": wire, "length_coeff": float(length_coeff)}
        return [float(r) for r in self._list("score", args)]

    def verify(self, claims: list[SampleClaim], settings: VerifySettings) -> list[SampleVerdict]:
        args = {"claims": [claim_to_wire(c) for c in claims], "settings": settings.to_wire()}
        try:
            return [verdict_from_wire(v) for v in self._list("verify", args)]
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(f"engine child sent a malformed verdict: {exc}") from exc

    async def agenerate(self, *args: Any, **kwargs: Any) -> list[Generation]:
        """:meth:`generate` in a worker thread (trio), so the event loop stays responsive."""
        import functools

        import trio

        return await trio.to_thread.run_sync(functools.partial(self.generate, *args, **kwargs))

    async def aprefill_batch(self, items: list[tuple[list[int], list[int]]]) -> list[Prefill]:
        """:meth:`prefill_batch` in a worker thread (trio)."""
        import trio

        return await trio.to_thread.run_sync(self.prefill_batch, items)


# -- the child side ------------------------------------------------------------------------------


def _make_engine(spec: dict[str, Any]) -> Engine:
    if spec.get("threads"):
        import torch

        torch.set_num_threads(int(spec["threads"]))
    chat = bool(spec.get("chat_template", False))
    if spec["kind"] == "torch":
        from node.compute.torch_engine import TorchEngine

        return TorchEngine.from_dir(
            spec["path"], dtype=spec["dtype"], device=spec["device"], chat_template=chat
        )
    if spec["kind"] == "vllm":
        from node.compute.vllm_engine import VllmEngine

        return VllmEngine(
            spec["path"], dtype=spec["dtype"], device=spec["device"], chat_template=chat
        )
    raise EngineError(f"unknown engine kind {spec['kind']!r}; use 'torch' or 'vllm'")


def _serve(engine: Engine | None, op: str, args: dict[str, Any]) -> tuple[Engine | None, Any]:
    if op == "init":
        engine = _make_engine(args)
        return engine, engine.info.__dict__
    if engine is None:
        raise EngineError("engine child got a request before init")
    if op == "generate":
        gens = engine.generate(
            args["prompts"],
            args["seeds"],
            args["temperature"],
            args["max_tokens"],
            args.get("sample_indices"),
            sampler=str(args.get("sampler", GUMBEL_2)),
        )
        return engine, [generation_to_wire(g) for g in gens]
    if op == "prefill_batch":
        items = [(list(p), list(t)) for p, t in args["items"]]
        return engine, [prefill_to_wire(p) for p in engine.prefill_batch(items)]
    if op == "load_weights":
        engine.load_weights(args["path"])
        return engine, None
    if op == "encode_prompts":
        return engine, engine.encode_prompts([str(t) for t in args["texts"]])
    if op == "decode":
        return engine, engine.decode([int(t) for t in args["tokens"]])
    if op == "score":
        scored = [
            ScoreItem([int(x) for x in t], str(a), str(v), tl, str(e))
            for t, a, v, tl, e in args["items"]
        ]
        return engine, engine.score(scored, float(args["length_coeff"]))
    if op == "verify":
        claims = [claim_from_wire(c) for c in args["claims"]]
        verdicts = engine.verify(claims, VerifySettings.from_wire(dict(args["settings"])))
        return engine, [verdict_to_wire(v) for v in verdicts]
    raise EngineError(f"unknown engine request {op!r}")


def main() -> None:
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the channel
    engine: Engine | None = None
    while True:
        try:
            request = read_frame(stdin)
        except EngineError as exc:
            print(f"engine child: {exc}", file=sys.stderr)
            return
        if request is None or request.get("op") == "close":
            return
        try:
            engine, result = _serve(engine, request["op"], request.get("args") or {})
            write_frame(stdout, {"ok": True, "result": result})
        except (SwarmError, KeyError, TypeError, ValueError, RuntimeError) as exc:
            write_frame(stdout, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    main()
