"""``python -m hpcsplit key=value ...``: the Hydra app (see :mod:`hpcsplit.launch`).

The ``profile=PATH`` / ``plan=PATH`` / ``switchboard=PATH`` shortcuts are rewritten before Hydra
parses the command line (``[Note: input shortcuts]`` in :mod:`hpcsplit.config`).
"""

from __future__ import annotations

import sys


def main() -> None:
    from hpcsplit.config import rewrite_argv

    sys.argv[1:] = rewrite_argv(sys.argv[1:])
    from hpcsplit.launch import hydra_main

    hydra_main()


if __name__ == "__main__":
    main()
