"""``python -m hpcsplit key=value ...``: the Hydra app (see :mod:`hpcsplit.launch.app`).

The ``profile=PATH`` / ``plan=PATH`` / ``switchboard=PATH`` shortcuts are rewritten before Hydra
parses the command line (``[Note: input shortcuts]`` in :mod:`hpcsplit.launch.config`).
"""

from __future__ import annotations

import sys

from hpcsplit.launch.app import hydra_main
from hpcsplit.launch.config import rewrite_argv


def main() -> None:
    sys.argv[1:] = rewrite_argv(sys.argv[1:])
    hydra_main()


if __name__ == "__main__":
    main()
