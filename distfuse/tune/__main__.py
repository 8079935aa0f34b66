"""``python -m distfuse.tune`` (also under ``torchrun ... -m distfuse.tune``): the ``distfuse-tune`` command."""

import sys

from distfuse.tune.cli import main

if __name__ == "__main__":
    sys.exit(main())
