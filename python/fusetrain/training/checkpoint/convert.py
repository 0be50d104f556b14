"""``python -m fusetrain.training.checkpoint.convert OLD.pth [--out NEW.pth]``:
rewrite a checkpoint you trust (one written by an older fusetrain) so that it
reads as data (NOTE [checkpoints are data]); see
:func:`fusetrain.training.checkpoint.files.convert`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .files import convert

__all__ = ["main"]


#: The exit status of a file that is missing or not a checkpoint (as argparse's for bad arguments).
EXIT_BAD_FILE = 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusetrain.training.checkpoint.convert",
                                     description="Rewrite a checkpoint you trust (e.g. one written by an older "
                                                 "fusetrain) so that it reads as data (torch.load "
                                                 "weights_only=True); the result is checked before it replaces "
                                                 "anything.")
    parser.add_argument("checkpoint", help="the file to read (its pickle may run code: only files you trust)")
    parser.add_argument("--out", default=None, help="where to write (default: replace the file)")
    args = parser.parse_args(argv)
    try:
        written = convert(args.checkpoint, args.out)
    except (ValueError, OSError) as e:  # missing, unreadable or not a checkpoint: nothing was written
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_FILE
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
