"""An unmodified transformers script runs three ways, stock, with patch_transformers() in
front and through ``python -m hf_paged run``, and prints the same text; the patched runs use
hf_paged's model."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import FLOAT32_RTOL

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(Path(__file__).parent / "scripts" / "generate_and_score.py")
PATCH_IN_FRONT = ("import sys, runpy, hf_paged; hf_paged.patch_transformers(); "
                  "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
WAYS = {
    "stock": [SCRIPT],
    "patched": ["-c", PATCH_IN_FRONT, SCRIPT],
    "run": ["-m", "hf_paged", "run", SCRIPT],
}


def run_script(way: str, checkpoint: str, timeout: float = 300) -> dict[str, list[str]]:
    """The script's output lines, grouped by their label (``generate``, ``chat``, ...)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, *WAYS[way], checkpoint], capture_output=True,
                          text=True, env=env, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, f"{way}: {done.stderr[-3000:]}"
    lines: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        label, _, rest = line.partition(": ")
        lines.setdefault(label, []).append(rest)
    return lines


def check_same_text(checkpoint: str, loss_tolerance: float, exact: bool = True) -> None:
    """``exact=False`` (bf16, where summation order can swap near-tied tokens): both patched
    ways print the same text, and each line agrees with stock's beyond its prompt."""
    runs = {way: run_script(way, checkpoint) for way in WAYS}
    stock = runs.pop("stock")
    assert stock["model class"] == ["transformers Qwen3ForCausalLM"]
    assert len(stock["generate"]) == 2 and len(stock["pipeline"]) == 2
    expected = {k: v for k, v in stock.items() if k not in ("model class", "loss")}
    for way, lines in runs.items():
        assert lines.pop("model class") == ["hf_paged Qwen3ForCausalLM"], way
        loss = float(lines.pop("loss")[0])
        assert math.isclose(loss, float(stock["loss"][0]), abs_tol=loss_tolerance,
                            rel_tol=FLOAT32_RTOL), way
        if exact:
            assert lines == expected, way
        else:
            assert lines.keys() == expected.keys(), way
            for label, texts in expected.items():
                for ours, theirs in zip(lines[label], texts, strict=True):
                    shared = os.path.commonprefix([ours, theirs])
                    assert len(shared) >= min(len(theirs), 12), (way, label, ours, theirs)
    if not exact:
        assert runs["patched"] == runs["run"]


def test_unmodified_script_three_ways(tiny_checkpoint):
    check_same_text(tiny_checkpoint, loss_tolerance=2e-4)
