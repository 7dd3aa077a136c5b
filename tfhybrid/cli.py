"""The ``tfhybrid`` command: a small dispatcher of subcommands.

Subcommands register themselves in ``COMMANDS`` as (help, add_arguments, run);
other modules may add theirs the same way.

    tfhybrid plan MODEL --np N --batch B [--machine m.json] [--json out.json] [--png out.png]
    tfhybrid plan --paradl-net F [--paradl-lc F] --paradl-plat F [--paradl-tiers F] --np N --batch B
    horovodrun -np N tfhybrid calibrate -o machine.json [--model NAME] [--quick]
    tfhybrid --version

``--help`` and ``--version`` import neither TensorFlow nor Horovod (the
subcommands import what they need when they run), so they answer at once
(tests/unit/test_cli_fast.py checks it).

Example:
    >>> main(["plan", "--help"])  # doctest: +SKIP
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

COMMANDS = {}


class UsageError(ValueError):
    """Bad command-line input: one line each, exit code 2, before any work."""

    def __init__(self, problems):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class _Parser(argparse.ArgumentParser):
    """argparse with its errors on one line (no usage block) and exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`).\n")


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


def _readable_file(value, flag, fix):
    """The problem with input file ``value`` of ``flag`` (None when it can be read)."""
    if not os.path.exists(value):
        return f"{flag} {value}: file not found; {fix}."
    if os.path.isdir(value):
        return f"{flag} {value}: is a directory, expected a file; {fix}."
    if not os.access(value, os.R_OK):
        return f"{flag} {value}: file is not readable; check its permissions."
    return None


def _writable_path(value, flag, example):
    """The problem with output file ``value`` of ``flag`` (None when it can be written)."""
    if os.path.isdir(value):
        return f"{flag} {value}: is a directory; give a file name, e.g. {flag} " \
               f"{os.path.join(value, example)}."
    directory = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(directory):
        return f"{flag} {value}: directory {directory} does not exist; create it first " \
               f"(mkdir -p {directory}) or write elsewhere."
    if not os.access(directory, os.W_OK):
        return f"{flag} {value}: directory {directory} is not writable; write elsewhere."
    return None


def _positive(value, flag, example):
    if value is not None and value < 1:
        return f"{flag} {value}: expected a positive integer, e.g. {flag} {example}."
    return None


def _model_problem(name, flag="MODEL"):
    from tfhybrid.oracle.models import KNOWN_MODELS  # noqa: WPS433
    if name.endswith(".keras"):
        return _readable_file(name, flag, "give an existing .keras file (model.save('m.keras')) "
                              f"or a known model name: {', '.join(sorted(KNOWN_MODELS))}")
    if name.lower().replace("-", "_") not in KNOWN_MODELS:
        return f"{flag} {name!r}: unknown model; expected a .keras file or one of " \
               f"{', '.join(sorted(KNOWN_MODELS))}."
    return None


def _check_plan_args(args):
    """Every problem with the arguments and files of ``plan`` that needs no model (cheap)."""
    from tfhybrid.oracle.api import STRATEGY_NAMES  # noqa: WPS433
    problems = [_positive(args.p, "--np", 8), _positive(args.batch, "--batch", 256),
                _positive(args.dataset_size, "--dataset-size", 1281167)]
    if args.strategies is not None:
        names = [n.strip() for n in args.strategies.split(",")]
        unknown = [n for n in names if n not in STRATEGY_NAMES]
        if unknown or not any(names):
            problems.append(f"--strategies {args.strategies!r}: unknown strategy "
                            f"{', '.join(map(repr, unknown or ['']))}; expected a "
                            f"comma-separated subset of {','.join(STRATEGY_NAMES)}.")
    calibrate_fix = "create one with `horovodrun -np N tfhybrid calibrate -o machine.json`, " \
                    "or omit --machine for the shipped ABCI V100 cluster"
    paradl_fix = "ParaDL's files are in github.com/TruongThaoNguyen/paraDL-analysis"
    if args.paradl_net:
        if args.model:
            problems.append(f"MODEL {args.model!r} and --paradl-net {args.paradl_net}: give "
                            "one model, a MODEL or a ParaDL .net file, not both.")
        if not args.paradl_plat and not args.machine:
            problems.append(f"--paradl-net {args.paradl_net}: needs the machine: add "
                            "--paradl-plat FILE.plat (ParaDL platform) or --machine m.json.")
        if args.paradl_plat and args.machine:
            problems.append(f"--paradl-plat {args.paradl_plat} and --machine {args.machine}: "
                            "give one machine, not both.")
    else:
        for flag, value in (("--paradl-lc", args.paradl_lc), ("--paradl-plat", args.paradl_plat)):
            if value:
                problems.append(f"{flag} {value}: applies only with --paradl-net FILE.net; add "
                                "it or remove this option.")
        if not args.model:
            problems.append("MODEL: missing; give a .keras file or a known model name "
                            "(e.g. `tfhybrid plan vgg16 --np 8 --batch 256`), or --paradl-net "
                            "FILE.net.")
    if args.paradl_tiers and not args.paradl_plat:
        problems.append(f"--paradl-tiers {args.paradl_tiers}: applies only with --paradl-plat "
                        "FILE.plat; add it or remove this option.")
    if args.model and not args.paradl_net:
        problems.append(_model_problem(args.model))
    files = (("--machine", args.machine, calibrate_fix), ("--paradl-net", args.paradl_net,
             paradl_fix), ("--paradl-lc", args.paradl_lc, paradl_fix),
             ("--paradl-plat", args.paradl_plat, paradl_fix),
             ("--paradl-tiers", args.paradl_tiers, "give abci_tiers.json or omit it"))
    problems += [_readable_file(value, flag, fix) for flag, value, fix in files if value]
    problems += [_writable_path(value, flag, example) for flag, value, example in (
        ("--json", args.json, "plan.json"), ("--png", args.png, "plan.png")) if value]
    if args.png and importlib.util.find_spec("matplotlib") is None:
        problems.append(f"--png {args.png}: needs matplotlib, which is not installed; "
                        "pip install 'tfhybrid[plot]' or drop --png.")
    problems = [p for p in problems if p]
    if problems:
        raise UsageError(problems)


def _read(flag, path, reader, fix):
    """``reader(path)``, any failure turned into one line naming the file and the fix."""
    try:
        return reader(path)
    except json.JSONDecodeError as err:
        raise UsageError(f"{flag} {path}: not valid JSON ({err.msg} at line {err.lineno} "
                         f"column {err.colno}); {fix}.") from None
    except Exception as err:  # noqa: BLE001 - a user's file may fail in any way: one line
        text = " ".join(str(err).split()).rstrip(".") or type(err).__name__
        if not isinstance(err, (ValueError, OSError)):
            text = f"{type(err).__name__}: {text}"
        if len(text) > 400:
            text = text[:397] + "..."
        raise UsageError(f"{flag} {path}: {text}; {fix}.") from None


def _load_plan_inputs(args):
    """(profile, machine, label, Keras model or None) from MODEL/--machine or the
    --paradl-* files.

    Reads (and checks) every file before building the model, the slow part.
    """
    from tfhybrid.oracle import machine as mach, paradl_io, profile  # noqa: WPS433
    _check_plan_args(args)
    machine_fix = "fix the file, or write a new one with `horovodrun -np N tfhybrid " \
                  "calibrate -o machine.json`"
    paradl_fix = "fix the file (see ParaDL's formats in tfhybrid/oracle/paradl_io.py)"
    machine = None
    if args.machine:
        machine = _read("--machine", args.machine, mach.Machine.load, machine_fix)
    if args.paradl_net:
        model = _read("--paradl-net", args.paradl_net, paradl_io.read_net, paradl_fix)
        if not model.profile.rows:
            raise UsageError(f"--paradl-net {args.paradl_net}: has no layer lines "
                             "(NAME|CxWxH|CxFxKxK|FxWxH); nothing to plan.")
        if args.paradl_lc:
            lc = _read("--paradl-lc", args.paradl_lc, paradl_io.read_lc, paradl_fix)
            model = _read("--paradl-lc", args.paradl_lc,
                          lambda _: paradl_io.apply_lc(model, lc),
                          "give the .lc file written for this .net model")
        if machine is None:
            machine = _read("--paradl-plat", args.paradl_plat, lambda path: paradl_io.read_plat(
                path, args.paradl_tiers, layer_times=model.layer_times), paradl_fix)
        return model.profile, machine, model.profile.name, None
    if machine is None:
        path = mach.cluster_machine_path()
        machine = mach.as_machine(path)
        print(f"no --machine: using {path} (ParaDL's ABCI V100 cluster); plan for yours "
              "with --machine m.json from `horovodrun -np N tfhybrid calibrate -o m.json`")
    from tfhybrid.oracle.models import build_model  # noqa: WPS433
    flag = "MODEL"
    model = _read(flag, args.model, build_model, "give a model saved with model.save('m.keras')")
    empty = UsageError(f"MODEL {args.model}: model {model.name!r} has no layer with weights "
                       "or compute (an empty model); nothing to plan. Give the model to train.")
    if not getattr(model, "layers", None):
        raise empty
    prof = _read(flag, args.model, lambda _: profile(model), "give a built Keras model "
                 "(Sequential/Functional with keras.Input)")
    if not prof.rows or not any(r.weights or r.fwd_flops for r in prof.rows):
        raise empty
    return prof, machine, model.name, model


def plan_text(model, p, batch, machine=None, strategies=None, model_parallel=None,
              label=None) -> str:
    """What ``tfhybrid plan`` prints, for a Keras model (or profile) in this process.

    Args:
        model: A built Keras model or a :class:`tfhybrid.oracle.ModelProfile`.
        p: World size.
        batch: Global mini-batch.
        machine: Machine JSON path, dict or Machine; None: the shipped ParaDL
            ABCI V100 cluster (as ``tfhybrid plan`` without ``--machine``).
        strategies: Names to rank (default: all).
        model_parallel: Only strategies with model groups of this size.
        label: The model's name in the first line (default: ``model.name``).

    Example:
        >>> print(plan_text(model, p=2, batch=64, strategies=("d", "gmp")))  # doctest: +SKIP
    """
    from tfhybrid.oracle import as_machine, rank, report  # noqa: WPS433
    from tfhybrid.oracle import machine as mach  # noqa: WPS433
    lines = []
    if machine is None:
        machine = mach.cluster_machine_path()
        lines.append(f"no machine given: using {machine} (ParaDL's ABCI V100 cluster)")
    machine = as_machine(machine)
    preds = _buildable(model, rank(model, p, batch, machine, strategies=strategies,
                                   model_parallel=model_parallel))
    label = label or getattr(model, "name", "model")
    lines.append(f"{label}: p={p}, B={batch}, machine: {machine.source or 'given'}")
    lines.append(report.format_table(preds))
    if strategies is None and model_parallel is None:
        lines += integrated_lines(model, model, p, batch, machine)
    return "\n".join(lines)


def integrated_lines(model, prof, p, batch, machine) -> list:
    """The ``per layer`` section of ``tfhybrid plan``: Gholami's integrated plan
    (Eq. 6, :mod:`tfhybrid.oracle.per_layer`) of every grid, with ``transform``'s
    verdict for a Keras model (what ``strategy="auto"`` weighs against the table)."""
    from tfhybrid.oracle import per_layer  # noqa: WPS433
    lines = ["per layer (Gholami Eq. 6; strategy='auto' weighs these against the table):"]
    for pl in per_layer.integrated_plans(prof, p, batch, machine):
        verdict = ""
        if model is not None and hasattr(model, "layers"):
            from tfhybrid.transformer.feasibility import refusal  # noqa: WPS433
            why = refusal(model, pl.strategy, p, pl.model_parallel, **pl.options)
            verdict = "  builds" if why is None else f"  transform refuses: {why[:100]}"
        choices = ", ".join(f"{c.name}:{c.choice}" for c in pl.layers)
        lines.append(f"  grid {p // pl.model_parallel}x{pl.model_parallel} {pl.strategy:<3} "
                     f"{pl.total_s * 1e3:9.3g} ms  {choices[:120]}{verdict}")
    return lines


def _buildable(model, preds):
    """The oracle's predictions, with choices ``tfhybrid.transform`` would refuse for
    this Keras model marked infeasible with its reason (the check ``auto`` uses)."""
    if model is None or not hasattr(model, "layers"):   # a profile or ParaDL files
        return preds
    from tfhybrid.transformer.feasibility import check_predictions  # noqa: WPS433
    try:
        return check_predictions(model, preds)
    except ValueError:   # transform reads no model of this kind at all: said per strategy
        return preds


@command("plan", "predict time and memory per strategy, ranked")
def plan(args):
    from tfhybrid.oracle import rank, report  # noqa: WPS433
    prof, machine, label, model = _load_plan_inputs(args)
    names = tuple(s.strip() for s in args.strategies.split(",")) if args.strategies else None
    preds = _buildable(model, rank(prof, args.p, args.batch, machine, strategies=names))
    print(f"{label}: p={args.p}, B={args.batch}, machine: {machine.source or 'given'}")
    print(report.format_table(preds))
    if not names:
        print("\n".join(integrated_lines(model, prof, args.p, args.batch, machine)))
    meta = {"model": label, "p": args.p, "batch": args.batch, "machine": machine.to_dict()}
    meta["machine"].pop("layer_times", None)
    meta["machine"].pop("split_scales", None)
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
    ap.add_argument("--collective-stat", choices=("best", "median", "mean"), default="best",
                    help="each collective's best repetition (default: reproducible on a "
                    "shared node), its median, or its mean without the fastest and slowest "
                    "fifth (across nodes: a step pays the network's spread)")


@command("calibrate", "fit alpha/beta, flop rate, layer times and gamma on this machine")
def calibrate(args):
    from tfhybrid.oracle.calibration import run as calibrate_run  # noqa: WPS433
    problems = [_writable_path(args.output, "-o", "machine.json"), _positive(args.sizes, "--sizes", 6),
                _positive(args.reps, "--reps", 5), _positive(args.batch, "--batch", 8)]
    if args.max_bytes < 4096:
        problems.append(f"--max-bytes {args.max_bytes}: expected at least 4096 (the smallest "
                        "message timed), e.g. --max-bytes 4194304.")
    if args.sizes is not None and args.sizes == 1:
        problems.append("--sizes 1: a line through one message size fits no bandwidth; "
                        "expected at least 2, e.g. --sizes 6.")
    if args.model:
        problems.append(_model_problem(args.model, "--model"))
    problems = [p for p in problems if p]
    if problems:
        raise UsageError(problems)
    if args.quick:
        args.max_bytes, args.sizes, args.reps = min(args.max_bytes, 1 << 18), 4, 3
    calibrate_run.run(args.output, args.max_bytes, args.sizes, args.reps, args.model,
                      args.batch, log=lambda s: print(s, flush=True),
                      collective_stat=args.collective_stat)
    return 0


calibrate.add_arguments = _calibrate_args


def version_text() -> str:
    """``tfhybrid X (tensorflow Y, keras Z, horovod W, python V)`` from the installed
    packages' metadata (no TensorFlow import)."""
    import importlib.metadata as metadata
    import platform

    from tfhybrid import __version__

    def installed(*names):
        for name in names:
            try:
                return metadata.version(name)
            except metadata.PackageNotFoundError:
                continue
        return "not installed"

    parts = [f"tensorflow {installed('tensorflow', 'tensorflow-cpu', 'tensorflow-gpu')}",
             f"keras {installed('keras')}", f"horovod {installed('horovod')}",
             f"python {platform.python_version()}"]
    return f"tfhybrid {__version__} ({', '.join(parts)})"


class _VersionAction(argparse.Action):
    """``--version``: print :func:`version_text` (computed only when asked) and exit 0."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="print tfhybrid's version and those of TensorFlow, Keras, Horovod"):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        parser.exit(0)


def build_parser():
    ap = _Parser(prog="tfhybrid", description="tfhybrid command-line tools")
    ap.add_argument("--version", action=_VersionAction)
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
    except UsageError as err:
        for problem in err.problems:
            print(f"tfhybrid {args.command}: error: {problem}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as err:
        text = " ".join(str(err).split()) or type(err).__name__
        print(f"tfhybrid {args.command}: error: {text}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
