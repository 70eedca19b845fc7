"""A restore or a migration in a process of its own, for the tests that kill it at a step or run two at once.

    python -m tests.support.state_child --state-dir DIR [--etcd URL] (--file BACKUP | --migrate-to BACKEND)
        [--replace] [--stop-at STEP] [--hold-at STEP --until PATH]

It prints `at <step>` as it passes each step (`checked`, `staged`, `committed`, `replaced <file>`, …), sleeps
forever at `--stop-at` (the test kills it there), waits at `--hold-at` until PATH exists, and ends with `restored`
(exit 0) or `refused: <message>` (exit 3).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from qiip_core import QiipError
from qiip_core.config import load_settings
from qiip_core.state import migrate, restore


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--etcd")
    parser.add_argument("--file", type=Path)
    parser.add_argument("--migrate-to", choices=["etcd", "embedded"])
    parser.add_argument("--replace", action="store_true")
    parser.add_argument("--stop-at")
    parser.add_argument("--hold-at")
    parser.add_argument("--until", type=Path)
    args = parser.parse_args()
    overrides: dict[str, object] = {"state_dir": args.state_dir}
    if args.etcd:
        overrides["etcd"] = {"endpoints": [args.etcd], "timeout_s": 5}
        if not args.migrate_to:
            overrides["registry"] = {"backend": "etcd"}
    settings = load_settings(**overrides)  # type: ignore[arg-type]

    def step(name: str) -> None:
        print(f"at {name}", flush=True)
        if name == args.stop_at:
            while True:
                time.sleep(60)
        if name == args.hold_at and args.until is not None:
            while not args.until.exists():
                time.sleep(0.01)

    try:
        if args.migrate_to:
            migrate(settings, to=args.migrate_to, replace=args.replace, on_step=step)
        else:
            restore(settings, args.file.read_bytes(), replace=args.replace, on_step=step)
    except QiipError as exc:
        print(f"refused: {exc.message}", flush=True)
        return 3
    print("restored", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
