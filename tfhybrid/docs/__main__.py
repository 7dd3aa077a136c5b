"""``python -m tfhybrid.docs [PAGE] [--path]``: list, print or locate a shipped page."""
from __future__ import annotations

import argparse
import sys

from tfhybrid import docs


def main(argv=None) -> int:
    """Print the page (or its path with ``--path``); with no page, list them all."""
    ap = argparse.ArgumentParser(prog="python -m tfhybrid.docs",
                                 description="tfhybrid's documentation pages shipped with the package")
    ap.add_argument("page", nargs="?", help=f"one of {', '.join(docs.PAGES)}")
    ap.add_argument("--path", action="store_true", help="print the file's path, not its text")
    args = ap.parse_args(argv)
    if args.page is None:
        for name in docs.PAGES:
            print(f"{name:10s} {docs.path(name)}")
        return 0
    try:
        print(docs.path(args.page) if args.path else docs.read(args.page), end="" if not args.path else "\n")
    except ValueError as err:
        print(f"{ap.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
