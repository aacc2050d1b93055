"""`deepinfer make-model`: write a random-weight checkpoint of any model family that has a maker.

    deepinfer make-model OUT_DIR [--family v4] [--size SIZE] [--seed N] [--force] [family flags]

`--family` is a model_type or an alias (default `v4`, DeepSeek-V4), looked up in the model registry
(`find_model_family`); the family's `ModelFamily.make_checkpoint` (a `CheckpointMaker`) supplies
the sizes, its own flags and the function that writes the folder. See the registry's docstring.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from deepinfer.models.common.errors import ModelFamilyPluginError
from deepinfer.models.registry import CheckpointMaker, ModelFamily, all_model_families, find_model_family

DEFAULT_FAMILY = "v4"
# the command's own arguments; every other parsed value is a family option
COMMAND_ARGS = ("out_dir", "family", "size", "seed", "force")


def find_maker(name: str) -> tuple[ModelFamily, CheckpointMaker]:
    """The family `name` (model_type or alias) and its maker; ValueError naming the families that
    have one if it has none (an unknown name: UnknownModelTypeError listing every family)."""
    family = find_model_family(name)
    if family.make_checkpoint is None:
        makers = [f.label for f in all_model_families() if f.make_checkpoint is not None]
        raise ValueError(f"model family {family.model_type!r} cannot write random checkpoints "
                         f"(ModelFamily.make_checkpoint is None); choose one of: {', '.join(makers) or 'none'}")
    return family, family.make_checkpoint


def build_parser(family: ModelFamily, maker: CheckpointMaker) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepinfer make-model",
        description=f"Write a random-weight checkpoint of model family {family.label}"
                    f"{': ' + family.description if family.description else ''}.")
    parser.add_argument("out_dir", help="directory to create")
    parser.add_argument("--family", default=DEFAULT_FAMILY,
                        help=f"model family: a model_type or alias (default: {DEFAULT_FAMILY})")
    parser.add_argument("--size", default=maker.sizes[0], choices=list(maker.sizes),
                        help=f"preset (default: {maker.sizes[0]})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    if maker.add_arguments is not None:
        maker.add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--family", default=DEFAULT_FAMILY)
    try:
        family, maker = find_maker(first.parse_known_args(argv)[0].family)
    except (ValueError, ModelFamilyPluginError) as e:  # UnknownModelTypeError is a ValueError
        print(f"deepinfer make-model: error: {e}", file=sys.stderr)
        return 2
    args = build_parser(family, maker).parse_args(argv)
    options = {k: v for k, v in vars(args).items() if k not in COMMAND_ARGS}
    try:
        summary = maker.make(Path(args.out_dir), args.size, args.seed, args.force, **options)
    except (ValueError, FileExistsError) as e:
        print(f"deepinfer make-model: error: {e}", file=sys.stderr)
        return 2
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
