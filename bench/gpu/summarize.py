"""Last step of bench/gpu_check.sh: one summary.json and one verdict from the steps' JSON files.

A step that wrote no JSON (killed by its timeout, or crashed before it could) counts as failed, with its
exit status and log named. Exit status: 1 when any step failed (a mismatch, a crash, a timeout), else 0;
with --strict-goals a missed goal fails too. Rehearsal goals are listed but not judged: tiny CPU shapes
say nothing about a GPU's throughput.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("gpu", "rehearsal"), required=True)
    ap.add_argument("--strict-goals", action="store_true")
    ap.add_argument("--wall", type=float, default=None, help="the whole check's wall seconds")
    args = ap.parse_args()
    out = Path(args.out)
    rows = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines() if line.strip()]
    steps, goals, env = {}, {}, {}
    for name, rc, wall, limit in rows:
        rc, wall, limit = int(rc), float(wall), int(limit)
        path = out / f"{name}.json"
        entry = {"rc": rc, "wall_s": round(wall, 1), "timeout_s": limit, "timed_out": rc in (124, 137),
                 "log": f"{name}.log"}
        if path.exists():
            rec = json.loads(path.read_text())
            env = env or rec.get("env", {})
            entry.update(ok=rec["ok"] and rc == 0, checks=len(rec["checks"]),
                         failed_checks=[c["name"] + ": " + c["detail"] for c in rec["checks"] if not c["ok"]],
                         error=((rec.get("error") or "").strip().splitlines() or [None])[-1],
                         goals=rec.get("goals", {}))
            for g, v in rec.get("goals", {}).items():
                goals[f"{name}.{g}"] = v
        else:
            why = f"timed out after {limit} s" if entry["timed_out"] else f"exited {rc} before writing {path.name}"
            entry.update(ok=False, checks=0, failed_checks=[why + f"; see {name}.log"], error=None, goals={})
        steps[name] = entry

    judged = args.mode == "gpu"
    failed = [n for n, s in steps.items() if not s["ok"]]
    missed = [g for g, v in goals.items() if not v["met"]]
    ok = not failed and not (args.strict_goals and judged and missed)
    summary = {
        "ok": ok, "mode": args.mode, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "wall_s": args.wall,
        "env": env, "steps": steps, "goals": goals, "goals_judged": judged, "strict_goals": args.strict_goals,
        "failed_steps": failed, "missed_goals": missed if judged else [],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))

    print()
    for n, s in steps.items():
        line = f"  {n:12s} {'PASS' if s['ok'] else 'FAIL'}  {s['wall_s']:6.1f} s"
        if not s["ok"]:
            line += "  — " + "; ".join(s["failed_checks"][:3] or [str(s.get("error"))])
        print(line)
    for g, v in goals.items():
        rel = ">=" if v["at_least"] else "<="
        state = ("met" if v["met"] else "MISSED") if judged else "not judged (rehearsal)"
        print(f"  goal {g}: {v['value']:.3g} ({rel} {v['goal']:.3g}) {state}")
    where = env.get("gpu") or f"CPU ({env.get('cpus')} cores)"
    verdict = "PASS" if ok else "FAIL"
    extra = f"; {len(missed)} goal(s) missed" if judged and missed else ""
    print(f"SUMMARY gpu_check ({args.mode}, {where}): {verdict} — {len(steps) - len(failed)}/{len(steps)} steps "
          f"passed{extra} — {args.wall or 0:.0f} s — figures in {out}/summary.json")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
