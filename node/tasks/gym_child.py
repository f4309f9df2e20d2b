"""The child that builds reasoning-gym items (``node.tasks.gym.build`` runs it with
``PYTHONHASHSEED=0``): reads the build request (JSON) on stdin, writes one canonical JSON item
per line to the path it is given, says progress on stderr every few seconds and, on a bad
request, one line ``error: ...`` and exit status 2."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

PROGRESS_EVERY_S = 5.0


def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _composite(request: dict[str, Any]) -> Any:
    from reasoning_gym.composite import CompositeConfig, CompositeDataset, DatasetSpec
    from reasoning_gym.factory import DATASETS

    from node.tasks.gym import installed_version

    known = set(DATASETS) - {"composite"}
    for d in request["datasets"]:
        if d["name"] not in known:
            close = sorted(n for n in known if d["name"][:3] in n)[:5]
            hint = f" (close: {', '.join(close)})" if close else ""
            _fail(
                f"reasoning-gym {installed_version()} has no data set {d['name']!r}{hint}; see"
                " reasoning_gym.factory.DATASETS for its names"
            )
    specs = [DatasetSpec(d["name"], d["weight"], dict(d["config"])) for d in request["datasets"]]
    try:
        return CompositeDataset(
            CompositeConfig(size=request["size"], seed=request["seed"], datasets=specs)
        )
    except (TypeError, ValueError, AssertionError) as exc:  # a config key or value it refuses
        _fail(f"reasoning-gym refused the config: {exc}".splitlines()[0])
    raise AssertionError("unreachable")


def main() -> None:
    dest = Path(sys.argv[1])
    check = "--check" in sys.argv[2:]
    request = json.loads(sys.stdin.read())
    composite = _composite(request)
    worst: dict[str, tuple[float, int]] = {}
    last = time.monotonic()
    with dest.open("w", encoding="utf-8") as out:
        for i in range(request["size"]):
            item = composite[i]
            try:
                line = json.dumps(item, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            except TypeError as exc:
                name = item.get("metadata", {}).get("source_dataset", "?")
                _fail(f"reasoning-gym data set {name}: its items are not JSON data ({exc})")
            if check:
                back = json.loads(line)
                name = back["metadata"]["source_dataset"]
                sub = composite.datasets[name]
                try:
                    score = float(sub.score_answer(back["answer"], back))
                except Exception as exc:
                    _fail(
                        f"reasoning-gym data set {name}: its scorer fails on its own answer ({exc})"
                    )
                if score < worst.get(name, (2.0, 0))[0]:
                    worst[name] = (score, i)
            out.write(line + "\n")
            if time.monotonic() - last >= PROGRESS_EVERY_S:
                last = time.monotonic()
                print(f"built {i + 1}/{request['size']} items", file=sys.stderr, flush=True)
    bad = {n: w for n, w in worst.items() if w[0] < 1.0}
    if bad:
        name, (score, i) = sorted(bad.items())[0]
        _fail(
            f"reasoning-gym data set {name}: its own scorer gives item {i}'s reference answer"
            f" {score:g}, not 1, once the item travels as JSON; a run could not reward a correct"
            " answer, so leave it out"
        )


if __name__ == "__main__":
    main()
