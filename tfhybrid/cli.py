"""The ``tfhybrid`` command: a small dispatcher of subcommands.

Subcommands register themselves in ``COMMANDS`` as (help, add_arguments, run);
other modules may add theirs the same way.

    tfhybrid plan MODEL --np N --batch B [--machine m.json] [--json out.json] [--png out.png]
    tfhybrid plan --paradl-net F [--paradl-lc F] --paradl-plat F [--paradl-tiers F] --np N --batch B
    horovodrun -np N tfhybrid calibrate -o machine.json [--model NAME] [--quick]

Example:
    >>> main(["plan", "--help"])  # doctest: +SKIP
"""
from __future__ import annotations

import argparse
import sys

COMMANDS = {}


def command(name, help_text):
    """Register ``fn(args)`` as a subcommand; ``fn.add_arguments(parser)`` declares flags."""
    def register(fn):
        COMMANDS[name] = (help_text, fn)
        return fn
    return register


def _plan_args(ap):
    ap.add_argument("model", nargs="?", help="a .keras file or a known model name: "
                    "vgg16, resnet50, alexnet, splitbrain_vgg, cosmoflow")
    ap.add_argument("--np", dest="p", type=int, required=True, help="world size p")
    ap.add_argument("--batch", type=int, required=True, help="global mini-batch B")
    ap.add_argument("--machine", help="machine JSON (default: the shipped ParaDL ABCI V100 "
                    "cluster, tfhybrid/oracle/machines/abci_v100.json; this CPU box: "
                    "machines/cpu_box.json; yours: `tfhybrid calibrate`)")
    ap.add_argument("--strategies", help="comma-separated subset (default: all)")
    ap.add_argument("--dataset-size", type=int, help="add per-epoch times to the JSON")
    ap.add_argument("--json", help="write the ranked predictions as JSON")
    ap.add_argument("--png", help="write a stacked bar chart (needs matplotlib)")
    ap.add_argument("--paradl-net", help="ParaDL model file (.net / .net_sc)")
    ap.add_argument("--paradl-lc", help="ParaDL layer configuration (.lc)")
    ap.add_argument("--paradl-plat", help="ParaDL platform file (.plat)")
    ap.add_argument("--paradl-tiers", help="per-tier alpha/beta JSON (e.g. abci_tiers.json)")


def _load_plan_inputs(args):
    """(profile, machine, label) from MODEL/--machine or the --paradl-* files."""
    from tfhybrid.oracle import machine as mach, paradl_io, profile  # noqa: WPS433
    if args.paradl_net:
        model = paradl_io.read_net(args.paradl_net)
        if args.paradl_lc:
            model = paradl_io.apply_lc(model, paradl_io.read_lc(args.paradl_lc))
        if args.machine:
            machine = mach.as_machine(args.machine)
        elif args.paradl_plat:
            machine = paradl_io.read_plat(args.paradl_plat, args.paradl_tiers,
                                          layer_times=model.layer_times)
        else:
            raise ValueError("--paradl-net needs --paradl-plat (or --machine) for the machine.")
        return model.profile, machine, model.profile.name
    if not args.model:
        raise ValueError("Give a MODEL (.keras file or known name) or --paradl-net FILE.")
    machine = args.machine
    if not machine:
        machine = mach.cluster_machine_path()
        print(f"no --machine: using {machine} (ParaDL's ABCI V100 cluster); plan for yours "
              "with --machine m.json from `horovodrun -np N tfhybrid calibrate -o m.json`")
    from tfhybrid.oracle.models import build_model  # noqa: WPS433
    model = build_model(args.model)
    return profile(model), mach.as_machine(machine), model.name


@command("plan", "predict time and memory per strategy, ranked")
def plan(args):
    from tfhybrid.oracle import rank, report  # noqa: WPS433
    prof, machine, label = _load_plan_inputs(args)
    names = tuple(s.strip() for s in args.strategies.split(",")) if args.strategies else None
    preds = rank(prof, args.p, args.batch, machine, strategies=names)
    print(f"{label}: p={args.p}, B={args.batch}, machine: {machine.source or 'given'}")
    print(report.format_table(preds))
    meta = {"model": label, "p": args.p, "batch": args.batch, "machine": machine.to_dict()}
    meta["machine"].pop("layer_times", None)
    if args.json:
        report.write_json(args.json, preds, meta, args.dataset_size)
        print(f"wrote {args.json}")
    if args.png:
        report.plot_png(args.png, preds, f"{label}: p={args.p}, B={args.batch}")
        print(f"wrote {args.png}")
    return 0


plan.add_arguments = _plan_args


def _calibrate_args(ap):
    ap.add_argument("-o", "--output", required=True, help="machine JSON to write (rank 0)")
    ap.add_argument("--max-bytes", type=int, default=4 << 20, help="largest message (bytes)")
    ap.add_argument("--sizes", type=int, default=6, help="number of message sizes")
    ap.add_argument("--reps", type=int, default=5, help="repetitions per timing (the best is kept)")
    ap.add_argument("--model", help="also time per-layer forward/backward and gamma of "
                    "this model (known name or .keras)")
    ap.add_argument("--batch", type=int, default=8, help="local batch for --model timings (also timed at batch x world)")
    ap.add_argument("--quick", action="store_true", help="small sizes, 3 reps (tests)")


@command("calibrate", "fit alpha/beta, flop rate, layer times and gamma on this machine")
def calibrate(args):
    from tfhybrid.oracle import calibrate_run  # noqa: WPS433
    if args.quick:
        args.max_bytes, args.sizes, args.reps = min(args.max_bytes, 1 << 18), 4, 3
    calibrate_run.run(args.output, args.max_bytes, args.sizes, args.reps, args.model,
                      args.batch, log=lambda s: print(s, flush=True))
    return 0


calibrate.add_arguments = _calibrate_args


def build_parser():
    ap = argparse.ArgumentParser(prog="tfhybrid", description="tfhybrid command-line tools")
    sub = ap.add_subparsers(dest="command", required=True)
    for name, (help_text, fn) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        fn.add_arguments(p)
        p.set_defaults(run=fn)
    return ap


def main(argv=None) -> int:
    """Entry point of the ``tfhybrid`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as err:
        print(f"tfhybrid {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
