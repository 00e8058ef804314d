"""Environment variables read by vllm-lens (runs in: any).

- ``VLLM_LENS_DISABLE``: ``1`` makes the plugin a complete no-op (nothing is patched or tapped).
- ``VLLM_LENS_WORKER_MAX_BYTES``: budget of captured rows held on each worker, running and
  waiting for their fetch (default 4 GiB); rows that would exceed it are refused and their
  request fails (rows already held are never dropped to make room).
- ``VLLM_LENS_ATTENTION_STEER_MAX_BYTES``: device memory each worker may hold for the keys and
  values of attention-steered requests (``steer_attention``; default 1 GiB); a request that
  would exceed it fails, nobody else's is dropped.
- ``VLLM_LENS_STAGING_POOL_BYTES``: host memory each worker keeps, free, for the staging
  tensors of the next steps' captures (default 512 MiB; ``0`` keeps none and allocates every
  step's afresh; CPU backend only: ``worker.staging_pool``).
- ``VLLM_LENS_SAE_MAX_BYTES``: weights of the SAEs one worker keeps loaded (default 4 GiB),
  with the copies it computes with (on CPU, a reordered encoder: ``saes.linear``); the least
  recently used that no request holds is unloaded to load another.
- ``VLLM_LENS_SAES``: path of a JSON file of named SAEs (``{name: path}`` or ``{name:
  {"path", "hook_point"}}``) the OpenAI server registers before it serves; over HTTP
  requests may name only these (``frontend.sae_names``).
- ``VLLM_LENS_FINISHED_TTL_S``: seconds a finished request's rows wait for their fetch before
  the worker drops them (default 600): covers aborted requests and front ends that went away.
- ``VLLM_LENS_HTTP_STORE_MAX_BYTES``: capacity of the OpenAI server's store behind the binary
  transport (default 2 GiB); a response that does not fit beside what it holds is refused
  (``CapacityError``, HTTP 503), nobody else's entries evicted.
- ``VLLM_LENS_HTTP_STORE_TTL_S``: seconds a binary-transport handle stays readable (default 300).
- ``VLLM_LENS_MAX_REQUEST_BYTES``: largest lens value (e.g. steering vectors) the OpenAI server
  accepts in one request's ``vllm_xargs`` (default 64 MiB); larger ones get HTTP 400.
- ``VLLM_LENS_MAX_CAPTURE_BYTES``: largest capture one request may ask for (default 1 GiB),
  estimated before it is scheduled as layers × positions it can select × hidden × dtype × n,
  with positions bounded by its prompt, ``max_tokens`` and the model's context; larger
  requests are refused.
- ``VLLM_LENS_MAX_DECODED_BYTES``: largest total size, decompressed, of the tensors in one
  request's lens values (default 256 MiB). Each tensor's declared dtype × shape is checked
  against it before anything is decompressed.
- ``VLLM_LENS_ALLOW_PICKLED_HOOKS``: ``1`` lets requests carry pickled ``Hook`` functions,
  i.e. lets anyone who can reach the server run arbitrary code on it. Off by default; named
  hooks (entry-point group ``vllm_lens.hooks``) need no opt-in.
- ``VLLM_LENS_ALLOW_PERSISTENT_HOOKS``: ``1`` enables the OpenAI server's ``/v1/hooks/*``
  routes. Persistent hooks see every client's requests and ``collect`` returns their results,
  so they are an operator's tool: off by default (403).
- ``VLLM_LENS_SHM_HANDOFF``: ``0`` sends every fetched capture inline in the RPC result
  (msgpack + zstd), as it travels between hosts, instead of through ``/dev/shm`` on the same
  host (default ``1``).
- ``VLLM_LENS_TEST_FAULTS``: ``1`` lets requests ask for an injected failure
  (``vllm_lens.common.faults``); for the test suite only.
- ``VLLM_LENS_TEST_LAYOUT``: with ``VLLM_LENS_TEST_FAULTS=1``, JSON that changes a model
  class's layout (model class -> ``Layout`` fields), so the suite can prove that the start-up
  check refuses a wrong one; for the test suite only.
- ``VLLM_LENS_LOGIT_LENS_MAX_ROWS``: most rows (positions × layers × samples) one request may
  run the ``logit_lens_topk`` named hook on (default 65536; declared by the hook's factory,
  read by ``vllm_lens.frontend.admission``).
- ``VLLM_LENS_SINKS``: the capture sinks requests may write to (JSON, or a JSON file's path);
  parsed and validated by ``vllm_lens.sinks.config``.
- ``VLLM_LENS_SINK_WRITER``: engine: a name (1 to 48 letters, digits, ``_``, ``.``, ``-``)
  this engine's workers write capture-sink datasets under, beside other engines writing the same
  datasets (independent engines of one job, e.g. Ray actors each starting its own); its
  shards are ``shard-<name>-NNNNN.safetensors`` (``vllm_lens.dataset.writer``). Under data or
  pipeline parallelism each worker adds its ranks (``<name>-dp<rank>-pp<rank>``; unset:
  ``dp<rank>-pp<rank>``). Unset with one engine and one stage: the worker writes alone.
- ``VLLM_LENS_STEERING_PRESETS``: path of a JSON file of named steering presets the OpenAI
  server registers before it serves (``frontend.presets``).
- ``VLLM_LENS_PAGE``: ``1`` serves the lens page at ``/lens`` on the OpenAI server (static
  files shipped in the package, calling the same HTTP API as every client; off by default:
  the page has no authentication of its own, ``frontend.http.routes_page``).
- ``VLLM_LENS_MAX_LIST_VALUES``: most numbers one choice's results may carry in the OpenAI
  server's ``lists`` transport (default 4,194,304); a larger answer is refused (HTTP 400
  naming ``activations_transport``): the ``json`` and ``binary`` forms carry it.
- ``VLLM_LENS_ALLOW_STEERING_ROUTES``: ``1`` enables ``/v1/steering/register`` and
  ``/v1/steering/unregister`` (a preset steers every client that selects it: off by default).
- ``VLLM_LENS_MAX_STEERING_VECTORS``: most steering vectors one request may carry, presets
  expanded (default 256); a preset's tensors also count towards ``VLLM_LENS_MAX_DECODED_BYTES``.
- ``VLLM_LENS_MAX_HOOKS``: most hooks one request may carry (default 32); the rows of a named
  hook that declares ``max_rows`` are summed over all of the request's hooks of that name.
- ``VLLM_LENS_MAX_SWEEP_CELLS``: most (layer, position) cells one ``patching_sweep`` may ask
  for (default 4096), each one engine request.
- ``VLLM_LENS_MAX_CONCURRENT_SWEEPS``: ``/v1/lens/patching_sweep`` calls one API process runs
  at once (default 2); more get HTTP 429. A sweep whose client disconnects is cancelled.
- ``VLLM_LENS_HOOK_RESULTS_MAX``: results of persistent hooks kept per worker, in requests
  (default 10000); past it the oldest requests' results are dropped.
- ``VLLM_LENS_ATTENTION_HOOK_MAX_ROWS``: most rows (positions × layers × samples) one request
  may run the ``attention_to_span`` named hook on (default 65536; read by
  ``vllm_lens.named_hooks``).
- ``VLLM_LENS_INNER_TAPS``: ``0`` puts no tap ops inside the decoder layers (the points read
  there are then refused), for plain traffic's speed; default ``1``.
- ``VLLM_LENS_HTTP_STORE_DIR``: the directory under which each OpenAI server makes the
  directory its API processes share (binary-transport store, preset log; default: the
  system's temporary directory; ``frontend.http.shared_dir``).
- ``VLLM_LENS_SERVER_DIR``: set by a server's launcher for the API processes it starts (that
  shared directory); not a setting.
- ``VLLM_LENS_CACHE``: where the demo models are built (default ``~/.cache/vllm_lens``;
  ``vllm_lens.demo_models``).
"""

from __future__ import annotations

import os

__all__ = [
    "allow_persistent_hooks", "allow_pickled_hooks", "allow_steering_routes",
    "attention_steer_max_bytes", "disabled",
    "finished_ttl_s", "hook_results_max", "http_store_max_bytes", "http_store_ttl_s",
    "max_capture_bytes", "max_concurrent_sweeps", "max_decoded_bytes", "max_hooks", "max_request_bytes",
    "max_steering_vectors", "max_sweep_cells", "sae_max_bytes",
    "shm_handoff", "sink_writer", "staging_pool_bytes", "steering_presets_path", "test_faults",
    "test_layout",
    "worker_max_bytes",
]


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").strip().lower() in ("1", "true", "yes", "on")


def disabled() -> bool:
    return _flag("VLLM_LENS_DISABLE")


def allow_pickled_hooks() -> bool:
    return _flag("VLLM_LENS_ALLOW_PICKLED_HOOKS")


def allow_persistent_hooks() -> bool:
    return _flag("VLLM_LENS_ALLOW_PERSISTENT_HOOKS")


def allow_steering_routes() -> bool:
    return _flag("VLLM_LENS_ALLOW_STEERING_ROUTES")


def lens_page() -> bool:
    return _flag("VLLM_LENS_PAGE")


def max_list_values() -> int:
    return int(os.environ.get("VLLM_LENS_MAX_LIST_VALUES", str(4 << 20)))


def max_sweep_cells() -> int:
    return int(os.environ.get("VLLM_LENS_MAX_SWEEP_CELLS", "4096"))


def max_concurrent_sweeps() -> int:
    return int(os.environ.get("VLLM_LENS_MAX_CONCURRENT_SWEEPS", "2"))


def max_steering_vectors() -> int:
    return int(os.environ.get("VLLM_LENS_MAX_STEERING_VECTORS", "256"))


def max_hooks() -> int:
    return int(os.environ.get("VLLM_LENS_MAX_HOOKS", "32"))


def steering_presets_path() -> str | None:
    return os.environ.get("VLLM_LENS_STEERING_PRESETS") or None


def sink_writer() -> str | None:
    """``VLLM_LENS_SINK_WRITER``, checked (``ValueError`` names the variable)."""
    import re

    value = os.environ.get("VLLM_LENS_SINK_WRITER", "").strip()
    if value and not re.fullmatch(r"[A-Za-z0-9_.-]{1,48}", value):
        raise ValueError(f"VLLM_LENS_SINK_WRITER={value!r} must be 1 to 48 letters, digits, "
                         "'_', '.' or '-' (the engine's name as a writer of capture-sink "
                         "datasets)")
    return value or None


def saes_path() -> str | None:
    return os.environ.get("VLLM_LENS_SAES") or None


def hook_results_max() -> int:
    return int(os.environ.get("VLLM_LENS_HOOK_RESULTS_MAX", "10000"))


def worker_max_bytes() -> int:
    return int(os.environ.get("VLLM_LENS_WORKER_MAX_BYTES", str(4 << 30)))


def attention_steer_max_bytes() -> int:
    return int(os.environ.get("VLLM_LENS_ATTENTION_STEER_MAX_BYTES", str(1 << 30)))


def staging_pool_bytes() -> int:
    return int(os.environ.get("VLLM_LENS_STAGING_POOL_BYTES", str(512 << 20)))


def sae_max_bytes() -> int:
    return int(os.environ.get("VLLM_LENS_SAE_MAX_BYTES", str(4 << 30)))


def finished_ttl_s() -> float:
    return float(os.environ.get("VLLM_LENS_FINISHED_TTL_S", "600"))


def http_store_max_bytes() -> int:
    return int(os.environ.get("VLLM_LENS_HTTP_STORE_MAX_BYTES", str(2 << 30)))


def http_store_ttl_s() -> float:
    return float(os.environ.get("VLLM_LENS_HTTP_STORE_TTL_S", "300"))


def max_request_bytes() -> int:
    return int(os.environ.get("VLLM_LENS_MAX_REQUEST_BYTES", str(64 << 20)))


def max_capture_bytes() -> int:
    return int(os.environ.get("VLLM_LENS_MAX_CAPTURE_BYTES", str(1 << 30)))


def max_decoded_bytes() -> int:
    return int(os.environ.get("VLLM_LENS_MAX_DECODED_BYTES", str(256 << 20)))


def shm_handoff() -> bool:
    return os.environ.get("VLLM_LENS_SHM_HANDOFF", "1").strip().lower() not in (
        "0", "false", "no", "off")


def inner_taps() -> bool:
    """Whether decoder layers get the taps inside them (``attn_out``/``resid_mid``,
    ``mlp_post``); read when the model is built, and by the front end for the compile cache."""
    return os.environ.get("VLLM_LENS_INNER_TAPS", "1").strip().lower() not in (
        "0", "false", "no", "off")


def test_faults() -> bool:
    return _flag("VLLM_LENS_TEST_FAULTS")


def test_layout() -> str | None:
    """``VLLM_LENS_TEST_LAYOUT``, honoured only with ``VLLM_LENS_TEST_FAULTS=1``."""
    return (os.environ.get("VLLM_LENS_TEST_LAYOUT") or None) if test_faults() else None
