"""``python -m abbench ...`` is the same as the ``abbench`` console script."""

from abbench.cli import app

if __name__ == "__main__":
    app()
