"""bench/hotswitch.py's per-bucket table: microseconds per token, predicted against measured,
on hand-made metrics whose answer is counted by hand."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import hotswitch  # noqa: E402


def _row(step: int, bucket_s: dict, bucket_tokens: dict) -> dict:
    return {
        "step": step,
        "step_s": sum(bucket_s.values()),
        "switch_s": 0.0,
        "tokens": sum(bucket_tokens.values()),
        "bucket_s": bucket_s,
        "bucket_tokens": bucket_tokens,
        "loss": 1.0,
    }


def test_bucket_table_divides_seconds_by_tokens_over_the_timed_steps() -> None:
    rows = [
        _row(1, {"16": 9.0}, {"16": 1000}),  # the first step warms up: not timed
        _row(2, {"16": 3.0, "32": 4.0}, {"16": 1000, "32": 2000}),
        _row(3, {"16": 2.0}, {"16": 1500}),  # no 32-token rows this step
    ]
    report = {
        "buckets": [
            {"edge": 16, "short": "dp2", "time_s": 1.5, "tokens_per_step": 1000},
            {"edge": 32, "short": "tp2", "time_s": 2.0, "tokens_per_step": 1000},
            {"edge": 64, "short": "tp2 rc", "time_s": 1.0, "tokens_per_step": 10},
        ]
    }
    measured = {"planned": hotswitch.summarize(rows)}
    lines = hotswitch.bucket_table({"planned": report}, measured).splitlines()
    # <=16: (3 + 2) s over (1000 + 1500) tokens = 2000 us; predicted 1.5 s / 1000 = 1500 us
    assert lines[2] == "| planned | <=16 | dp2 | 1,000 | 1,250 | 1500.00 | 2000.00 | -25.0% |"
    # <=32: 4 s over 2000 tokens = 2000 us (a step without the bucket adds nothing to either)
    assert lines[3] == "| planned | <=32 | tp2 | 1,000 | 1,000 | 2000.00 | 2000.00 | +0.0% |"
    # <=64 never ran: no measured figure
    assert lines[4] == "| planned | <=64 | tp2 rc | 10 | n/a | 100000.00 | n/a | n/a |"
