"""The ``vllm-lens extract`` command's own flags, and its ``--help`` (runs in: caller).

The command also takes every vLLM engine flag (``EngineArgs``); its ``--help`` shows its own
flags first, each described once, then how to list vLLM's (``--help=all``, or a group such as
``--help=ParallelConfig``), which vLLM's parser answers.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

__all__ = ["USAGE", "add_extract_flags", "extract_help"]

USAGE = ("vllm-lens extract --model MODEL --input FILE_OR_DIR --output DIR [extract options] "
         "[vLLM engine options]")
_DESCRIPTION = ("Write the activations (and SAE features) of a prompt file to an activation "
                "dataset, with the engine's workers writing the rows. A re-run resumes.")


def add_extract_flags(parser: Any) -> None:
    """Add extract's own flags (not vLLM's) to ``parser``."""
    own = parser.add_argument_group("extract options")
    own.add_argument("--input", required=True, type=Path,
                         help="the prompt file: JSONL, CSV or Parquet whose rows have prompt "
                              "(text) or messages (a chat, rendered with the model's chat "
                              "template) and an optional key; or a directory, read with Hugging "
                              "Face datasets (save_to_disk, or data files for load_dataset). "
                              "Required")
    own.add_argument("--split", default=None,
                         help="with a dataset directory of several splits: the one to read "
                              "(default: its only split; not for a file)")
    own.add_argument("--output", required=True, type=Path,
                     help="the dataset directory, created if missing; a re-run skips the keys "
                          "already written and refuses a dataset made with other settings. "
                          "Required")
    own.add_argument("--layers", default=None,
                         help="comma-separated decoder layer indices (3,7), or all; required "
                              "unless --sae is given")
    own.add_argument("--points", default=None,
                         help="comma-separated tap points captured at every --layers layer "
                              "(resid_pre, attn_out, resid_mid, mlp_out, resid_post ...; see "
                              "vllm_lens.common.points); needs --layers (default resid_post)")
    own.add_argument("--sae", action="append", default=None,
                         help="an SAE whose top features to write per row (a directory; "
                              "with --server a name the server registered); repeatable")
    own.add_argument("--top-k", type=int, default=32,
                         help="with --sae: features kept per row (default 32)")
    own.add_argument("--sae-reconstruction", action="store_true",
                         help="with --sae: also write each row's reconstruction error (NMSE) "
                              "and L0 (default off)")
    own.add_argument("--format", choices=("vllm-lens", "sae-lens"), default="vllm-lens",
                         help="vllm-lens (default), or sae-lens: one point at one layer in "
                              "sae-lens' cached-activations layout (a Hugging Face dataset), "
                              "to train SAEs on")
    own.add_argument("--context-size", type=int, default=128,
                         help="with --format sae-lens: token rows per context (default 128)")
    own.add_argument("--positions", default="all",
                         help="which token rows to write, a positions selector: all (default), "
                              "prompt, generated, last_prompt, or a slice such as prompt[-4:]")
    own.add_argument("--reduce", choices=("mean", "last"), default=None,
                     help="one row per example and layer: the mean or the last of the "
                          "selected rows (default: every selected row; not with --sae)")
    own.add_argument("--max-tokens", type=int, default=0,
                         help="tokens to generate per prompt, greedily; the first N-1 get rows "
                              "(default 0: the prompt only)")
    own.add_argument("--batch-size", type=int, default=256,
                         help="prompts handed to the engine at once (default 256; bounds memory)")
    own.add_argument("--rows-per-shard", type=int, default=65536,
                     help="rows per safetensors shard (default 65536; shards also end at "
                          "1 GiB)")
    own.add_argument("--server", default=None,
                         help="a lens-enabled vLLM server's URL: run the prompts there (rows "
                              "come back over HTTP and are written here; engine options are "
                              "then ignored, --model is the served model's name, optional)")
    own.add_argument("--api-key-env", default="OPENAI_API_KEY",
                         help="with --server: the environment variable holding its API key (default "
                              "OPENAI_API_KEY)")
    own.add_argument("--ray", action="store_true",
                         help="run --num-engines engines as Ray Data actors (each a vLLM engine "
                              "with the engine options below, TP/PP inside it), all writing "
                              "the one dataset at --output (the `ray` extra)")
    own.add_argument("--num-engines", type=int, default=None,
                         help="with --ray: how many engine actors (default 1)")
    own.add_argument("--ray-address", default=None,
                         help="with --ray: the Ray cluster to join (default: a local Ray "
                              "instance); --output must be a folder every node mounts at the "
                              "same path")


def extract_help() -> str:
    """``vllm-lens extract --help``: its own flags, then vLLM's engine flags by group."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    own = argparse.ArgumentParser(prog="vllm-lens extract", usage=USAGE,
                                  description=_DESCRIPTION, add_help=False)
    own.add_argument("-h", "--help", action="help",
                     help="show this help and exit; --help=all lists every vLLM engine flag, "
                          "--help=GROUP (e.g. --help=ModelConfig) one group's")
    own.add_argument_group("model").add_argument(
        "--model", help="the model: a Hugging Face name or a local directory; required "
                        "(with --server: the served model's name, optional, default the "
                        "server's first model)")
    add_extract_flags(own)
    engine = FlexibleArgumentParser(prog="vllm-lens extract", usage=argparse.SUPPRESS,
                                    add_help=False)
    EngineArgs.add_cli_args(engine)
    groups = engine.format_help().strip()
    return (own.format_help().rstrip() + "\n\nvLLM engine options: any `vllm serve` engine "
            "flag (--dtype, -tp, --max-model-len ...).\n`vllm-lens extract --help=all` lists "
            "them all, `--help=GROUP` one group:\n\n" + groups + "\n")
