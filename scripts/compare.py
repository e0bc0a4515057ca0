"""GRPO, DAPO, R³ and R³'s ablations on the same budget over seeds: one table, one plot.

    python scripts/compare.py                                  # every variant, seeds 0 1 2, configs/arith.py
    python scripts/compare.py --steps 60 --parallel 2 --out runs/compare
    python scripts/compare.py --variants grpo r3 --seeds 0 1 2 3 4
    python scripts/compare.py --devices 0,1,2,3 --parallel 4  # one run per GPU / TPU chip

Every (variant, seed) is a `train.py` run in `OUT/<variant>/seed<k>` (its log in `train.log` there); rerunning
the command skips finished runs and resumes interrupted ones. `--report_only` tabulates what has finished.
Writes `OUT/compare.md` (the table), `OUT/compare.json` (every number, per seed too) and `OUT/curves.png`
(held-out accuracy against step, mean ± std bands). See `r3jax.train.compare` for what each column means.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from r3jax.train import compare  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "arith.py"))
    parser.add_argument("--out", default="runs/compare")
    parser.add_argument("--variants", nargs="+", default=list(compare.VARIANTS), choices=list(compare.VARIANTS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per run (the same for every variant)")
    parser.add_argument("--eval_every", type=int, default=10, help="held-out evaluation (and checkpoint) interval")
    parser.add_argument("--reference", default="grpo", help="the variant whose final accuracy the others race to")
    parser.add_argument("--parallel", type=int, default=1, help="runs at the same time")
    parser.add_argument("--devices", default=None, help="comma-separated device ids handed out to the run slots")
    parser.add_argument("--report_only", action="store_true", help="only tabulate the runs that have finished")
    parser.add_argument("overrides", nargs="*",
                        help="more train.py flags for every run, e.g. --config.rl.learning_rate=1e-4")
    args, extra = parser.parse_known_args()
    extra = [*args.overrides, *extra]
    if args.steps < 1 or args.eval_every < 1 or args.parallel < 1:
        parser.error("--steps, --eval_every and --parallel must be positive")
    if args.reference not in args.variants:
        parser.error(f"--reference {args.reference!r} is not among --variants")
    out = pathlib.Path(args.out).resolve()
    jobs = compare.plan(args.variants, args.seeds, out, train_py=str(ROOT / "train.py"), config=args.config,
                        steps=args.steps, eval_every=args.eval_every, extra=extra)
    if not args.report_only:
        print(f"{len(jobs)} runs ({len(args.variants)} variants x {len(args.seeds)} seeds, {args.steps} steps) "
              f"in {out}", flush=True)
        devices = args.devices.split(",") if args.devices else None
        compare.run_jobs(jobs, args.steps, parallel=args.parallel, devices=devices,
                         log=lambda m: print(m, flush=True))
    per_run, missing = compare.collect(jobs, args.steps)
    if args.reference not in per_run:
        print(f"compare.py: error: no finished {args.reference} run to compare against", file=sys.stderr)
        return 1
    table = compare.aggregate(per_run, args.reference)
    settings = {"config": args.config, "steps": args.steps, "eval_every": args.eval_every, "seeds": args.seeds,
                "overrides": extra}
    print(compare.write_report(out, table, per_run, args.reference, settings))
    print(f"Table: {out / 'compare.md'}  numbers: {out / 'compare.json'}  curves: {out / 'curves.png'}")
    if missing:
        print(f"{len(missing)} runs did not finish: " + ", ".join(f"{j.variant}/seed{j.seed}" for j in missing),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
