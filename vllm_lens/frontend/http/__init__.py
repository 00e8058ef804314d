"""Lens support in vLLM's OpenAI-compatible server: the HTTP layer of the front end (runs in:
front end).

Nothing to configure: when the plugin loads in a process that builds the API server, it

- wraps ``/v1/completions`` and ``/v1/chat/completions``: lens keys in ``vllm_xargs`` are
  validated *before* the request is scheduled (a bad one gets HTTP 400 naming the field, also
  for ``stream: true``), and each choice of the response gets its own ``activations``;
- with ``stream: true``, activations arrive in one extra chunk per choice, sent after the
  choice's last token and before ``data: [DONE]`` (a chunk with empty text / delta, no
  finish reason, and ``activations``);
- with ``stream: true`` and ``stream_activations``, every chunk of a choice also carries the
  rows computed since its previous chunk (``activations``), and the extra chunk the rest:
  laid end to end they are the whole capture;
- with ``"activations_transport": "binary"`` a choice carries a handle instead of the tensors
  (see ``vllm_lens.activations``); the bytes are served by ``GET /v1/lens/activations/{handle}``
  and freed by ``DELETE`` on the same path or when they expire; with ``"lists"`` every
  tensor of the response is plain numbers (``wire.tensor_to_lists``);
- adds ``GET /v1/lens/model`` (what a lens request can ask of the served model),
  ``GET /v1/lens/stats`` (bytes waiting in the binary store and on each worker; the
  workers' figures are at most a second old, one worker call serving every GET meanwhile) and the
  persistent-hook routes ``/v1/hooks/{register, collect, clear, clear_results, prefetch,
  clear_prefetched}`` (``frontend.persistent_hooks``), which answer 403 unless the operator
  set ``VLLM_LENS_ALLOW_PERSISTENT_HOOKS=1`` (they see every client's traffic);
- refuses lens keys on routes that would drop their results (``/v1/responses``,
  ``/v1/messages``, transcriptions ...) with HTTP 400 naming the key;
- refuses pickled hooks (per request or registered) with 403 unless the operator set
  ``VLLM_LENS_ALLOW_PICKLED_HOOKS=1``; named hooks need no opt-in. A hook that raises fails its
  HTTP request with a 500 whose message carries the hook's error and traceback summary.

- with ``VLLM_LENS_PAGE=1``, serves the lens page at ``/lens`` (``routes_page``: three static
  files, which call the routes above like any client).

The API routes live under ``/v1``, so ``--api-key`` guards them like vLLM's own; the page's
static files under ``/lens`` are not guarded (they hold no data; the page sends the key the
user types with its API calls).

One job per module: ``install`` (wiring into vLLM's server), ``endpoints`` (the completions
and chat wrapper), ``results`` (a choice's lens results as JSON fields), ``streaming`` (the
streamed chunks), ``errors`` (errors as HTTP answers), ``bodies`` (request bodies, the
answering process's header), ``blob_store`` (the binary transport's store), ``shared_dir``
and ``preset_log`` (what the API processes of one server share), and one ``routes_*`` module
per group of vllm-lens's own routes. Nothing is imported here: ``vllm_lens.plugin`` imports
``install`` only in a process that builds the server.
"""
