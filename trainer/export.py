"""`python -m trainer.export CHECKPOINT OUT`: the documented command name; the exporter
itself is `trainer.run.export`."""

from __future__ import annotations

import sys

from trainer.run.export import main

if __name__ == "__main__":
    sys.exit(main())
