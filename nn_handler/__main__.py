"""``python -m nn_handler info [--json]`` and ``python -m nn_handler check [--nprocs N]``.

See :mod:`nn_handler._cli`; ``docs/cli.md`` describes the output.
"""

import sys

from ._cli import main

if __name__ == "__main__":
    sys.exit(main())
