"""Project vs classical reference training speed; see copytask.bench (same as `python -m copytask bench`)."""

from copytask.bench.command import main

if __name__ == "__main__":
    raise SystemExit(main())
