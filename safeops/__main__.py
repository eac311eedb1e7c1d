"""``python -m safeops``: the seed-case report (see ``safeops._report``)."""

from ._report import main

if __name__ == "__main__":
    raise SystemExit(main())
