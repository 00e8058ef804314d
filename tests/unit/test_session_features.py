"""Each front-end feature owns its state; the session only holds it (issue 43)."""

from __future__ import annotations

from vllm_lens.frontend.offline import OfflineCall
from vllm_lens.frontend.persistent_hooks import PersistentHooks
from vllm_lens.frontend.presets import Presets
from vllm_lens.frontend.sae_names import SaeNames
from vllm_lens.frontend.session import LensSession


def test_a_feature_state_is_made_once_per_session_and_kept_apart():
    a, b = LensSession(), LensSession()
    assert Presets.of(a) is Presets.of(a) is a.feature(Presets)
    Presets.of(a).specs["up"] = ()
    SaeNames.of(a).by_name["s"] = ("/d", None, {})
    PersistentHooks.of(a).trusted = True
    assert Presets.of(b).specs == {} and SaeNames.of(b).by_name == {}
    assert PersistentHooks.of(b).trusted is False
    assert a.feature(OfflineCall).parsed_by_params == {}


def test_the_session_names_no_feature():
    """The request side keeps facts, the requests in flight and the features' states: a
    feature that stored its registry on the session again fails here."""
    fields = set(vars(LensSession()))
    assert fields == {"facts", "in_flight", "_sinks", "model_names", "_features"}


def test_preset_restore_puts_back_what_snapshot_saw():
    presets = Presets()
    before = presets.snapshot("up")
    presets.specs["up"], presets.info["up"] = (), {"name": "up"}
    kept = presets.snapshot("up")
    presets.restore("up", before)
    assert "up" not in presets.specs and "up" not in presets.info
    presets.restore("up", kept)
    assert presets.info["up"] == {"name": "up"}
