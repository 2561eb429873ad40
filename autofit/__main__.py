"""``python -m autofit``: the command line (:mod:`autofit.cli`)."""

from autofit.cli import main

if __name__ == "__main__":
    main(prog_name="autofit")
