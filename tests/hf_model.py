"""The small Hugging Face model of ``scripts/make_test_model.py``, for tests (a script, not a
package module, so it is loaded from its file)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "make_test_model.py"


def make_test_model(out: Path, **kwargs: object) -> Path:
    """Write the test model (Qwen2, BPE tokenizer, chat template) to ``out``."""
    spec = importlib.util.spec_from_file_location("make_test_model", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path: Path = module.make_model(out, **kwargs)
    return path
