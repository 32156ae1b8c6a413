"""`python -m ds_stpar` is the `ds-stpar` command."""

from ds_stpar.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
