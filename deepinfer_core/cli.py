"""The `deepinfer` console script: `deepinfer serve [flags]` (python -m deepinfer_core.serve) and
`deepinfer generate [flags]` (python -m deepinfer_core.generate)."""
from __future__ import annotations

import sys

COMMANDS = ("serve", "generate")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        print(f"usage: deepinfer {{{','.join(COMMANDS)}}} [flags]  (`deepinfer COMMAND --help` lists the flags)",
              file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        from .serve.__main__ import main as serve
        return serve(rest)
    from .generate import main as generate
    return generate(rest)


if __name__ == "__main__":
    sys.exit(main())
