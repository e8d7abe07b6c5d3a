"""``python -m abbench.engine [--backend engine|transformers] [flags]``: serve the vendored engine, or the
transformers reference (see :mod:`abbench.engine.serve.launch`)."""

from abbench.engine.serve.launch import main

if __name__ == "__main__":
    raise SystemExit(main())
