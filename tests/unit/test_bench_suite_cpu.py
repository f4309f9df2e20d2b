"""bench/suite_cpu.py's report: totals, the two-core lower bound, each worker's last end, and a
clear refusal of an empty file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from suite_cpu import report  # noqa: E402


def test_the_report_sums_and_bounds_and_shows_the_balance(tmp_path: Path) -> None:
    rows = [
        {
            "id": "tests/a.py::x",
            "start": 0.0,
            "end": 10.0,
            "wall": 10.0,
            "busy": 18.0,
            "worker": "gw0",
        },
        {
            "id": "tests/b.py::y",
            "start": 0.0,
            "end": 8.0,
            "wall": 8.0,
            "busy": 4.0,
            "worker": "gw1",
        },
        {
            "id": "tests/a.py::z",
            "start": 10.0,
            "end": 12.0,
            "wall": 2.0,
            "busy": 2.0,
            "worker": "gw0",
        },
    ]
    out = report(rows, cores=2)
    assert out["tests"] == 3 and out["wall_s"] == 20.0 and out["busy_core_s"] == 24.0
    assert out["lower_bound_s"] == 12.0
    assert out["worker_last_end_s"] == {"gw0": 12.0, "gw1": 8.0}
    assert out["modules"][0] == {"module": "tests/a.py", "wall_s": 12.0, "busy_core_s": 20.0}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "suite_cpu.py"),
            str(path),
            "--cores",
            "2",
            "--json",
            str(tmp_path / "out.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "lower bound on 2 cores" in done.stdout, done.stderr
    assert json.loads((tmp_path / "out.json").read_text())["lower_bound_s"] == 12.0


def test_an_empty_file_is_refused_with_what_to_do(tmp_path: Path) -> None:
    empty = tmp_path / "none.jsonl"
    empty.write_text("")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "suite_cpu.py"), str(empty)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "run pytest with -p suite_cpu first" in done.stderr
