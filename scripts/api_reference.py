"""Write attnflow's API reference, generated from the docstrings by pdoc, to a folder.

    python scripts/api_reference.py docs/api      # `make docs`; open docs/api/index.html

Every module of the package is documented except the command-line modules (``attnflow/cli``:
their reference is ``attnflow COMMAND --help``).
"""

from __future__ import annotations

import pkgutil
import sys
import warnings
from pathlib import Path


def library_modules() -> list[str]:
    """The importable names of attnflow's modules, the CLI's left out."""
    import attnflow

    walked = pkgutil.walk_packages(attnflow.__path__, "attnflow.")
    return ["attnflow", *sorted(module.name for module in walked if not module.name.startswith("attnflow.cli"))]


def main(folder: str) -> None:
    import pdoc

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pdoc cannot resolve the package's lazily imported names
        pdoc.pdoc(*library_modules(), output_directory=Path(folder))
    print(f"wrote {Path(folder) / 'index.html'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "docs/api")
