"""``python -m abbench.engine [flags]``: serve the vendored engine (see ``abbench.engine.server``)."""

from abbench.engine.server import main

if __name__ == "__main__":
    raise SystemExit(main())
