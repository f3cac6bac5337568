"""``model-server`` entry point."""

from __future__ import annotations

import logging
import sys

from .backends import BackendUnavailable
from .config import parse_args
from .serving import run


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = parse_args(argv)
    try:
        run(config)
    except BackendUnavailable as exc:
        print(f"model-server: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
