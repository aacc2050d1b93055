"""The `deepinfer` command: version, plugin listing, doctor, and the sub-commands of other modules."""
from __future__ import annotations

import argparse
import importlib
import json
import sys

from deepinfer import envs
from deepinfer.version import __version__

# Sub-commands implemented elsewhere: name -> ("module:function", help). Each takes argv.
DELEGATED = {
    "generate": ("deepinfer.entrypoints.generate:main", "generate text from a prompt (offline)"),
    "make-model": ("deepinfer.entrypoints.make_model:main",
                   "write a random-weight checkpoint (--family, default v4: DeepSeek-V4)"),
    "conformance": ("deepinfer.testing.conformance:main", "run the back-end conformance kit"),
    "serve": ("deepinfer.entrypoints.serve:main", "OpenAI-compatible HTTP server (chat, completions, metrics)"),
    "audit-determinism": ("deepinfer.entrypoints.audit_determinism:main",
                          "compare requests alone vs batched, chunked and preempted (tokens, logprobs bitwise)"),
    "eval": ("deepinfer.entrypoints.eval:main", "benchmark evaluation (AIME, GPQA, HLE): generate, score, report"),
}


def cmd_plugins(args) -> int:
    from deepinfer.models.registry import MODEL_FAMILY_GROUP
    from deepinfer.plugins import ACCELERATOR_GROUP, FEATURE_GROUP, discover

    rows = [info for group in (ACCELERATOR_GROUP, FEATURE_GROUP, MODEL_FAMILY_GROUP)
            for infos in discover(group).values() for info in infos]
    if args.json:
        print(json.dumps([{"name": r.name, "group": r.group, "value": r.value, "distribution": r.distribution,
                           "version": r.version} for r in rows], indent=2))
        return 0
    print(_table(["name", "group", "distribution", "version", "object"],
                 [[r.name, r.group, r.distribution, r.version, r.value] for r in rows]))
    return 0


def cmd_doctor(args) -> int:
    from deepinfer.plugins import (ACCELERATOR_GROUP, PluginError, discover, feature_specs, probe,
                                   select_accelerator_class)

    rows = []
    for name in sorted(discover(ACCELERATOR_GROUP)):
        result, info = probe(name)
        rows.append([name, "yes" if result.usable else "no", info.version if info else "-", result.reason])
    print(f"deepinfer {__version__}")
    print(_table(["accelerator", "usable", "version", "reason"], rows))
    specs, errors = feature_specs()
    features = [[name, "on" if spec.enabled_by_default else "off", spec.description or "-"]
                for name, (_, spec) in sorted(specs.items())]
    features += [[name, "-", f"failed to load: {message}"] for name, message in sorted(errors.items())]
    print("\n" + _table(["feature", "default", "description"], features))
    print("\nenvironment variables:\n" + envs.describe())
    chosen = envs.get("DEEPINFER_ACCELERATOR")
    try:
        cls = select_accelerator_class(chosen)
    except PluginError as exc:
        print(f"\nerror: {exc}", file=sys.stderr)
        return 1
    how = "DEEPINFER_ACCELERATOR" if chosen else "auto-selected"
    print(f"\nselected: {cls.name} ({how})")
    return _print_layout(args, cls)


def _print_layout(args, accelerator_cls) -> int:
    """The parallel layout `--ep/--dp/--cp` (and RANK/WORLD_SIZE) would give, each rank's devices,
    threads, EP group and CP group, and whether this release runs it."""
    from deepinfer.parallel.groups import check_subgroups
    from deepinfer.parallel.launch import check_devices, default_threads, device_count, rank_environment
    from deepinfer.parallel.layout import ParallelConfigError, check_runnable, resolve_layout

    accelerator = accelerator_cls.name
    try:
        layout = resolve_layout(args.ep, args.dp, args.cp, accelerator)
        check_runnable(layout)
        check_subgroups(layout, accelerator_cls, accelerator)
        check_devices(layout, accelerator, device_count(accelerator_cls))
    except ParallelConfigError as exc:
        print(f"\nlayout: refused: {exc}", file=sys.stderr)
        return 1
    threads = default_threads(layout)
    print(f"\nlayout: {layout.describe()}; this node runs ranks {list(layout.local_ranks())}")
    for what, size, groups in (("expert-parallel", layout.ep, layout.ep_groups()),
                               ("context-parallel", layout.cp, layout.cp_groups())):
        if size > 1:
            print(f"{what} groups: " + ", ".join(_ranks(g) for g in groups))
    if layout.cp > 1:
        print(f"context parallel: the ranks of a CP group split each long prefill chunk zig-zag into "
              f"{2 * layout.cp} chunks (CP rank i takes chunks i and {2 * layout.cp - 1}-i); decode runs on "
              f"every rank of the group in lockstep")
    for local, rank in enumerate(layout.local_ranks()):
        devices = rank_environment(accelerator, layout, local)
        seen = ", ".join(f"{k}={v}" for k, v in devices.items()) or "host CPU"
        print(f"  rank {rank}: {seen}, {threads} threads (--threads_per_rank); "
              f"{_member('EP', layout.ep, layout.ep_group(rank), rank)}; "
              f"{_member('CP', layout.cp, layout.cp_group(rank), rank)}")
    return 0


def _ranks(group: range) -> str:
    return f"[{group.start}..{group.stop - 1}]"


def _member(what: str, size: int, group: range, rank: int) -> str:
    """'EP group 1 [2..3], EP rank 0' (or 'no EP group' when the size is 1)."""
    if size == 1:
        return f"no {what} group ({what.lower()} 1)"
    return f"{what} group {group.start // size} {_ranks(group)}, {what} rank {group.index(rank)}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)] if rows else [len(h) for h in header]
    widths[-1] = 0  # the last column is free text; do not pad it
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * len(h) for h in header])] + [fmt(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in DELEGATED:
        target, _ = DELEGATED[argv[0]]
        module, func = target.split(":")
        return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="deepinfer", description="DeepSeek-V4 inference engine")
    parser.add_argument("--version", action="version", version=f"deepinfer {__version__}")
    sub = parser.add_subparsers(dest="command")
    p = sub.add_parser("plugins", help="list installed accelerator, feature and model-family plugins (without "
                                       "importing them)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p = sub.add_parser("doctor", help="probe every accelerator and show which one and which parallel layout "
                                      "would be used")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size to check (default: the back end's)")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size to check (default: ep // cp)")
    p.add_argument("--cp", type=int, default=1, help="context-parallel size to check (default 1)")
    for name, (_, help_text) in DELEGATED.items():
        sub.add_parser(name, help=help_text, add_help=False)
    args = parser.parse_args(argv)
    if args.command == "plugins":
        return cmd_plugins(args)
    if args.command == "doctor":
        return cmd_doctor(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
