"""Where an instance's time went, from its steps at debug level: each kind of step (what it
carried: E images encoded, P prompt tokens prefilled, D decodes), how many, their share of
the time, measured against predicted, and what the mean step held.

    hydrad start ... --log-level debug > daemon.log 2>&1
    python bench/step_log.py daemon.log [--skip N] [--worker 0] [--out steps.json]

A step's debug line reads: ``step: I images, T tokens in C chunks (D decodes); vision V ms
(predicted PV), language L ms (predicted PL); step thread's CPU U ms``. ``--skip`` leaves
out each worker's first N steps (a warm-up).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

from common import write_json

STEP = re.compile(
    r"worker(?P<worker>\d+): step: (?P<images>\d+) images, (?P<tokens>\d+) tokens in (?P<chunks>\d+) chunks "
    r"\((?P<decodes>\d+) decodes\); vision (?P<vision>[\d.]+) ms \(predicted (?P<pvision>[\d.]+)\), "
    r"language (?P<language>[\d.]+) ms \(predicted (?P<planguage>[\d.]+)\); step thread's CPU (?P<cpu>[\d.]+) ms")


def parse(lines, skip: int = 0, worker: int | None = None) -> list[dict]:
    """The steps of ``lines``, each a dict of numbers, without each worker's first ``skip``."""
    seen: dict[int, int] = defaultdict(int)
    steps = []
    for line in lines:
        m = STEP.search(line)
        if m is None:
            continue
        step = {k: (float(v) if "." in v else int(v)) for k, v in m.groupdict().items()}
        if worker is not None and step["worker"] != worker:
            continue
        seen[step["worker"]] += 1
        if seen[step["worker"]] > skip:
            steps.append(step)
    return steps


def kind(step: dict) -> str:
    """``E`` images, ``P`` prompt tokens, ``D`` decodes: what the step carried."""
    return ("E" if step["images"] else "") + ("P" if step["tokens"] > step["decodes"] else "") + (
        "D" if step["decodes"] else "")


def summarize(steps: list[dict]) -> dict:
    total = sum(s["vision"] + s["language"] for s in steps) or 1.0
    groups: dict[str, list[dict]] = defaultdict(list)
    for step in steps:
        groups[kind(step)].append(step)
    kinds = {}
    for name, group in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        measured = sum(s["vision"] + s["language"] for s in group)
        predicted = sum(s["pvision"] + s["planguage"] for s in group)
        n = len(group)
        kinds[name] = {
            "steps": n,
            "seconds": measured / 1e3,
            "share": measured / total,
            "measured_over_predicted": measured / predicted if predicted else None,
            "mean_ms": measured / n,
            "mean_decodes": sum(s["decodes"] for s in group) / n,
            "mean_prompt_tokens": sum(s["tokens"] - s["decodes"] for s in group) / n,
            "mean_images": sum(s["images"] for s in group) / n,
            "thread_cpu_over_wall": sum(s["cpu"] for s in group) / measured if measured else None,
        }
    return {"steps": len(steps), "seconds": total / 1e3 if steps else 0.0, "kinds": kinds}


def table(summary: dict) -> str:
    rows = [f"{summary['steps']} steps, {summary['seconds']:.1f} s",
            "| step | steps | share of the time | measured / predicted | mean | decodes | prompt tokens | images |",
            "|---|---|---|---|---|---|---|---|"]
    for name, k in summary["kinds"].items():
        ratio = "-" if k["measured_over_predicted"] is None else f"{k['measured_over_predicted']:.2f}"
        rows.append(f"| {name} | {k['steps']} | {100 * k['share']:.1f}% | {ratio} | {k['mean_ms']:.1f} ms | "
                    f"{k['mean_decodes']:.1f} | {k['mean_prompt_tokens']:.0f} | {k['mean_images']:.2f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="the daemon's log, written with --log-level debug ('-': standard input)")
    parser.add_argument("--skip", type=int, default=0, help="leave out each worker's first N steps")
    parser.add_argument("--worker", type=int, help="only this worker's steps")
    parser.add_argument("--out", help="the summary as JSON")
    args = parser.parse_args()
    with (open(args.log, errors="replace") if args.log != "-" else sys.stdin) as f:
        steps = parse(f, args.skip, args.worker)
    if not steps:
        raise SystemExit(f"error: no step lines in {args.log} (start the daemon with --log-level debug)")
    summary = summarize(steps)
    print(table(summary))
    if args.out:
        write_json(args.out, summary)


if __name__ == "__main__":
    main()
