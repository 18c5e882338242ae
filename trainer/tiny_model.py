"""`python -m trainer.tiny_model [OUT_DIR]`: the documented command name; the builder
itself is `trainer.run.tiny_model`."""

from __future__ import annotations

from trainer.run.tiny_model import main

if __name__ == "__main__":
    main()
