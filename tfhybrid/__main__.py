"""``python -m tfhybrid ...``: the ``tfhybrid`` command (:mod:`tfhybrid.cli`), for
environments where the console script is not on ``PATH``.

Example:
    $ python -m tfhybrid plan vgg16 --np 8 --batch 256
"""
import sys

from tfhybrid.cli import main

if __name__ == "__main__":
    sys.exit(main())
