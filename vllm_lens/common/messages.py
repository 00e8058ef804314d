"""The typed answers of the worker RPCs: what a worker sends back to the front end (runs in: front
end, worker).

Each ``lens_*`` method of ``worker.extension.LensWorkerExtension`` answers with one record
defined here; the front end reads it with ``read`` / ``read_all`` and then by attribute. They
are msgspec ``Struct``\\ s, as vLLM's own engine messages (``vllm/v1/engine/__init__.py``),
because of how an answer travels:

- worker -> engine core: vLLM's multiprocess executor pickles it through its shared-memory
  queue (``MessageQueue.enqueue``), so the front end of an engine in one process (tests,
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) receives the record itself;
- engine core -> front end: the utility result is msgpack (``vllm.v1.serial_utils``'s
  ``MsgpackEncoder``), which writes a ``Struct`` as a map of its field names and decodes it
  as a plain ``dict`` (unless ``VLLM_ALLOW_INSECURE_SERIALIZATION``, which brings the record
  back itself).

``read`` accepts both: the record as it is, or a map that it converts field by field; any
other shape, a missing field (named in the error) or another version raises
``WorkerAnswerError`` (a ``LensExecutionError``).

**Version rule.** Every top-level record carries its version in its tag, the ``lens_message``
field written into each encoded answer (``"lens_stats/1"``): the RPC's name and
``VERSION``. Renaming, removing or retyping a field of any record, nested ones included, bumps
``VERSION``. Adding a field *with a default* does not: an older reader ignores it (unknown
fields are skipped) and a newer reader fills the default in for an older worker — so a field
an older reader must not ignore (one that refuses something, as ``DescribeAnswer.
refused_points`` does) is added without a default, with a new ``VERSION``. The fields defined
with this version have no defaults, so a worker that forgot one is refused, never read as a
silent default. Version 2 added the layout check's fields to ``DescribeAnswer``; version 3
``FetchPart.monitors``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import msgspec

from vllm_lens.errors import LensExecutionError

__all__ = [
    "TAG_FIELD", "VERSION", "AttentionMeta", "DescribeAnswer", "FetchAnswer", "FetchPart",
    "FlushAnswer", "HookResultsAnswer", "Message", "ParamsAnswer", "SaeAnswer",
    "SaeSliceAnswer", "StatsAnswer", "WorkerAnswerError", "read", "read_all",
]

#: The version of every record below (see the version rule above).
VERSION = 3
#: The field naming each encoded answer's record and version.
TAG_FIELD = "lens_message"

Handoff = bytes | dict[str, str]
"""One capture as ``common.handoff.send`` packed it: ``wire`` bytes, or a file's path."""


class Message(msgspec.Struct, frozen=True, kw_only=True, tag_field=TAG_FIELD):
    """Base of the top-level answers: each subclass is tagged ``"<rpc>/<VERSION>"``."""


def _tag(rpc: str) -> str:
    return f"{rpc}/{VERSION}"


class AttentionMeta(msgspec.Struct, frozen=True, kw_only=True):
    """One layer's attention as one TP rank holds it (``worker.attention_taps``): what
    ``vllm_lens.attention`` needs to rebuild its pattern."""

    layer: int
    scale: float
    logits_soft_cap: float
    sliding_window: list[int]
    alibi_slopes: list[float] | None
    """This rank's heads' slopes (the front end joins the ranks')."""
    sinks: list[float] | None
    num_heads: int
    num_kv_heads: int
    head_size: int
    layer_name: str
    kv_cache_dtype: str = "auto"
    """vLLM's ``kv_cache_dtype`` of the layer (``"auto"``: the model's dtype)."""

    def as_dict(self) -> dict[str, Any]:
        """The form users see in ``activations["qk_meta"]`` (without ``layer``)."""
        out = msgspec.structs.asdict(self)
        del out["layer"]
        return out


class LayoutCheckSummary(msgspec.Struct, frozen=True, kw_only=True):
    """The start-up check of one rank's layout (``worker.layout_check.LayoutCheck``)."""

    ran: bool
    """The check's forward pass ran (else nothing was proven on this rank)."""
    passed: list[str]
    """The invariants that held."""
    seconds: float
    error: str | None
    """Why the forward pass could not run, if it did not."""


class DescribeAnswer(Message, frozen=True, tag=_tag("lens_describe")):
    """``lens_describe``: what one rank's model looks like, and whether it serves lens
    requests (``unsupported``: why not, or ``None``)."""

    unsupported: str | None
    model_class: str
    mapped: bool
    """Every decoder layer was found and tapped."""
    n_layers: int
    local_layers: list[int]
    """The layers this pipeline stage holds."""
    pre_taps: bool
    hidden_size: int
    dtype: str
    """``torch`` dtype name without ``torch.``."""
    max_model_len: int
    tp_rank: int
    pp_rank: int
    speculative: bool
    tp_size: int
    dp_size: int
    num_heads_total: int
    num_kv_heads_total: int
    sites: list[str]
    """The tap sites this rank's layers have (``common.points.SITES``)."""
    d_mlp: int
    split: bool
    block: str
    n_experts: int
    moe_top_k: int
    unmapped: str | None
    """Why layers were not mapped, or ``None``."""
    inner_taps: bool
    qk_meta: list[AttentionMeta]
    """Per layer of this stage with Q/K taps (the front end joins the stages' lists)."""
    derived_layout: bool
    """The layout was derived from the module tree (``worker.layout_derivation``)."""
    refused_points: dict[str, str]
    """Point -> why this rank's start-up check of the layout refuses it
    (``worker.layout_check``)."""
    layout_check: LayoutCheckSummary | None
    """What that check found, once it ran (``None`` before, or on an unmapped model)."""
    readout_refused: str | None = "this worker does not describe its readout"
    """Why this rank cannot carry a direct logit attribution to the logits (``None``: it can,
    ``worker.readout``). The default refuses: an older worker's answer serves none."""
    vocab_size: int = 0
    heads_refused: str | None = "this worker does not describe its output projections"
    """Why this rank cannot attribute per head (``worker.head_projection``; ``None``: it can).
    The default refuses."""

    @classmethod
    def refused(cls, reason: str) -> DescribeAnswer:
        """The answer of a worker that could not be inspected: lens requests are refused."""
        return cls(unsupported=reason, model_class="?", mapped=False, n_layers=0,
                   local_layers=[], pre_taps=False, hidden_size=0, dtype="float32",
                   max_model_len=0, tp_rank=0, pp_rank=0, speculative=False, tp_size=1,
                   dp_size=1, num_heads_total=0, num_kv_heads_total=0, sites=[], d_mlp=0,
                   split=False, block="sequential", n_experts=0, moe_top_k=0, unmapped=None,
                   inner_taps=True, qk_meta=[], derived_layout=False, refused_points={},
                   layout_check=None)


class FetchPart(msgspec.Struct, frozen=True, kw_only=True):
    """What one rank sends for one engine request (``lens_fetch``, ``lens_fetch_partial``)."""

    error: str | None
    """Why this rank failed the request, or ``None``."""
    conflict: bool
    """The error is the sink refusing an example that conflicts with its dataset."""
    capacity: str | None
    """The error is a full worker budget: the setting that sizes it."""
    held: bool
    """This rank still held the request's record (its lens work ran here)."""
    seen: list[str]
    """The signals whose rows this rank keeps for the request's layers."""
    captures: dict[str, Handoff]
    """Signal -> its rows (``common.handoff``)."""
    hooks: bytes | None
    """``worker.hooks.encode_results`` (TP rank 0 of each stage)."""
    gates: bytes | None
    """``worker.steer.pack_gates`` (TP rank 0)."""
    monitors: bytes | None
    """``worker.monitors.pack_scores`` (TP rank 0)."""
    receipt: dict[str, Any] | None
    """The capture sink's receipt for the part this rank wrote (its own format)."""

    @classmethod
    def failed(cls, error: str, *, conflict: bool = False,
               capacity: str | None = None) -> FetchPart:
        """A request this rank failed."""
        return cls(error=error, conflict=conflict, capacity=capacity, held=False, seen=[],
                   captures={}, hooks=None, gates=None, monitors=None, receipt=None)

    @classmethod
    def rows(cls, captures: dict[str, Handoff]) -> FetchPart:
        """Rows alone (a streamed fetch, or rows whose request record is gone)."""
        return cls(error=None, conflict=False, capacity=None, held=False, seen=[],
                   captures=captures, hooks=None, gates=None, monitors=None, receipt=None)


class FetchAnswer(Message, frozen=True, tag=_tag("lens_fetch")):
    """``lens_fetch`` and ``lens_fetch_partial``: lens key -> engine request id -> part; a
    request this rank holds nothing for is left out."""

    requests: dict[str, dict[str, FetchPart]]

    def only(self, key: str) -> FetchAnswer:
        """This answer for lens key ``key`` alone."""
        found = self.requests.get(key)
        return FetchAnswer(requests={} if found is None else {key: found})

    def handoffs(self) -> list[Handoff]:
        """Every capture in the answer (to discard those nobody will read)."""
        return [sent for parts in self.requests.values() for part in parts.values()
                for sent in part.captures.values()]


class StatsAnswer(Message, frozen=True, tag=_tag("lens_stats")):
    """``lens_stats``: what one rank holds for lens requests."""

    entries: int
    """Captured entries waiting to be fetched."""
    bytes: int
    """Their host bytes."""
    records: int
    """Request records."""
    device_bytes: int
    """Device bytes of their steering vectors."""
    saes: int
    """SAEs kept loaded."""
    sae_bytes: int
    """Their weights' bytes (``VLLM_LENS_SAE_MAX_BYTES``)."""
    staging_bytes: int
    """Host memory the staging pool keeps for later steps' captures."""

    def as_json(self) -> dict[str, int]:
        """The form ``GET /v1/lens/stats`` lists per worker."""
        return msgspec.structs.asdict(self)


class HookResultsAnswer(Message, frozen=True, tag=_tag("lens_collect_hook_results")):
    """``lens_collect_hook_results``: engine request id -> ``worker.hooks.encode_results``."""

    results: dict[str, bytes]


class ParamsAnswer(Message, frozen=True, tag=_tag("lens_prefetch_params")):
    """``lens_prefetch_params``: parameter name -> its full tensor (``wire`` bytes)."""

    params: dict[str, bytes]


class FlushAnswer(Message, frozen=True, tag=_tag("lens_flush_sinks")):
    """``lens_flush_sinks``: what failed to be written since the last flush."""

    problems: list[str]


class SaeAnswer(Message, frozen=True, tag=_tag("lens_load_sae")):
    """``lens_load_sae``: the SAE's description (``spec.saes``), or why it cannot be used."""

    description: dict[str, Any] | None
    error: str | None


class SaeSliceAnswer(Message, frozen=True, tag=_tag("lens_sae_slice")):
    """``lens_sae_slice``: some features' rows and columns (``wire`` bytes), ``None`` from a
    rank that does not keep the SAE; or why they cannot be given."""

    data: bytes | None
    error: str | None


class WorkerAnswerError(LensExecutionError):
    """A worker answered a ``lens_*`` RPC with a record the front end cannot read: another
    version of these messages, or a field missing or of the wrong type.

    Never the caller's fault (a ``LensExecutionError``, HTTP 500): the front end and the
    workers run different vllm-lens code, or one of them has a bug. The message names the
    RPC and the field.

    Attributes:
        rpc: the worker method that answered.

    Examples:
        >>> from vllm_lens.common.messages import WorkerAnswerError
        >>> str(WorkerAnswerError("lens_stats", "Object missing required field `bytes`"))
        'vllm-lens cannot read the answer of lens_stats: Object missing required field `bytes`'
    """

    def __init__(self, rpc: str, problem: str) -> None:
        super().__init__(f"vllm-lens cannot read the answer of {rpc}: {problem}")
        self.rpc = rpc


M = TypeVar("M", bound=Message)


def read(cls: type[M], raw: Any) -> M:
    """``raw``, one worker's answer, as a ``cls`` record.

    Raises:
        WorkerAnswerError: ``raw`` is another record, another version, or a map missing a
            field or holding one of the wrong type (the error names it).
    """
    rpc, _, _ = cls.__struct_config__.tag.rpartition("/")
    if isinstance(raw, cls):
        return raw
    expected = cls.__struct_config__.tag
    if not isinstance(raw, Mapping):
        raise WorkerAnswerError(rpc, f"a {type(raw).__name__} instead of a {cls.__name__} "
                                "record")
    tag = raw.get(TAG_FIELD)
    if tag != expected:
        raise WorkerAnswerError(rpc, f"{TAG_FIELD}={tag!r} where this front end reads "
                                f"{expected!r} (a worker of another vllm-lens version?)")
    try:
        return msgspec.convert(raw, cls)
    except msgspec.ValidationError as exc:
        raise WorkerAnswerError(rpc, str(exc)) from None


def read_all(cls: type[M], answers: Sequence[Any]) -> list[M]:
    """``read`` for each worker's answer to one ``collective_rpc``."""
    return [read(cls, raw) for raw in answers]
