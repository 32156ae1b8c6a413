"""`ds-stpar demo`, the README's main job, end to end (2 CPU processes, a few steps)."""

import json
import subprocess
import sys


def test_demo_trains_with_switching_and_writes_its_run_folder(tmp_path):
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "ds_stpar", "demo", "--steps", "8", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name in (
        "ds_stpar.json",
        "config.json",
        "metrics.jsonl",
        "loss.png",
        "lengths.png",
        "timeline.png",
    ):
        assert (out / name).stat().st_size > 0, name
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    # a freshly initialised byte-level model starts near ln(258) = 5.55 and must learn
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.3
    assert sum(r["switches"] for r in rows) > 0, "the demo's plan never switched layouts"
    assert "loss" in proc.stdout and "bucket" in proc.stdout
