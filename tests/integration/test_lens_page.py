"""The lens page (``VLLM_LENS_PAGE=1``) driven in headless Chromium against the suite's SmolLM2
server: every number it shows equals the API's own answer to the same request, it loads
nothing from outside the server, and a screenshot of each view is kept.

Chromium and ChromeDriver are the system's (Debian's ``chromium`` and ``chromium-driver``;
``make test`` installs them as root, ``.ci/run`` requires them), never a browser downloaded at
test time. Without them this module is skipped, unless ``VLLM_LENS_REQUIRE_BROWSER=1``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import httpx
import pytest
import torch

from vllm_lens import NamedHook
from vllm_lens.client import LensClient
from vllm_lens.attention import attention_patterns

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    if os.environ.get("VLLM_LENS_REQUIRE_BROWSER") == "1":
        raise RuntimeError("VLLM_LENS_REQUIRE_BROWSER=1 but chromium and chromedriver are not "
                           "installed (Debian: apt-get install chromium chromium-driver)")
    pytest.skip("no chromium + chromedriver (Debian: apt-get install chromium chromium-driver)",
                allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

#: Where the screenshots of each view are kept (a CI artefact; ignored by git).
ARTIFACTS = Path(os.environ.get("VLLM_LENS_TEST_ARTIFACTS",
                                Path(__file__).resolve().parents[2] / "test-artifacts"))
PROMPT = "The Eiffel Tower is in the city of"
MAX_TOKENS = 4
LAYER, HEAD = 9, 5


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                "--window-size=1400,1600", "--disable-background-networking",
                "--disable-component-update", "--no-first-run"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def _shot(driver, element_id: str, name: str) -> None:
    out = ARTIFACTS / "lens-page"
    out.mkdir(parents=True, exist_ok=True)
    driver.find_element(By.ID, element_id).screenshot(str(out / f"{name}.png"))


def _state(driver, expression: str):
    return json.loads(driver.execute_script(f"return JSON.stringify({expression});"))


def _wait(driver, predicate, timeout: float = 300):
    def done(d):
        error = d.find_element(By.ID, "error").text
        assert not error, f"the page shows an error: {error}"
        return predicate(d)

    WebDriverWait(driver, timeout, poll_frequency=0.2).until(done)


def test_lens_page_shows_what_the_api_answers(smol_server, browser):
    base = smol_server.base_url
    driver = browser
    driver.get(f"{base}/lens")
    _wait(driver, lambda d: "layers" in d.find_element(By.ID, "model").text, 60)
    n_layers = _state(driver, "lensState.facts.n_layers")
    assert n_layers == 30

    prompt = driver.find_element(By.ID, "prompt")
    prompt.clear()
    prompt.send_keys(PROMPT)
    tokens = driver.find_element(By.ID, "max-tokens")
    tokens.clear()
    tokens.send_keys(str(MAX_TOKENS))
    Select(driver.find_element(By.ID, "attn-layer")).select_by_value(str(LAYER))
    Select(driver.find_element(By.ID, "attn-head")).select_by_value(str(HEAD))
    driver.find_element(By.ID, "run").click()
    _wait(driver, lambda d: "prompt tokens" in d.find_element(By.ID, "status").text)

    layers = list(range(n_layers))
    with LensClient(base) as client:
        api = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                              hooks=[NamedHook("logit_lens_topk", layers, {"k": 3})],
                              sae_features=[{"sae": "smol-l10", "top_k": 32,
                                             "positions": "all"}])
    ids = api.prompt_token_ids + api.token_ids
    assert _state(driver, "lensState.run.ids") == ids
    # The attention view asks for the run's own tokens (all but the last) as the prompt.
    assert _state(driver, "lensState.attention.ids") == ids[:-1]
    with LensClient(base) as client:
        qk = client.generate(ids[:-1], max_tokens=1, temperature=0,
                             output_qk=[LAYER]).activations

    # The logit-lens grid: every cell's token and probability, as drawn.
    saved = api.hook_results["0"]
    cells = driver.execute_script(
        "return [...document.querySelectorAll('#logit-lens td[data-layer]')].map(td => "
        "[+td.dataset.layer, +td.dataset.position, +td.dataset.tokenId, +td.dataset.prob, "
        "td.textContent]);")
    assert len(cells) == n_layers * (len(ids) - 1)
    for layer, position, token, prob, text in cells:  # JSON keys the layers by string
        row = saved["positions"][str(layer)].tolist().index(position)
        assert token == saved["token_ids"][str(layer)][row, 0].item(), (layer, position)
        assert prob == pytest.approx(math.exp(saved["logprobs"][str(layer)][row, 0].item()),
                                     rel=1e-6, abs=1e-9)
    last = {c[1]: c for c in cells if c[0] == n_layers - 1}
    # The last layer's top token after the prompt is the model's own greedy next token.
    assert last[len(api.prompt_token_ids) - 1][2] == api.token_ids[0]
    strings = {token: httpx.post(f"{base}/detokenize", json={"tokens": [token]}).json()["prompt"]
               for token in {c[2] for c in cells[:50]}}
    for _, _, token, _, text in cells[:50]:
        assert text == strings[token].replace("\n", "⏎")
    _shot(driver, "logit-lens-view", "logit_lens")

    # One head's attention pattern: the page's weights equal vllm_lens.attention's on the
    # API's Q/K of every head (the same token-id prompt), at that head.
    weights = driver.execute_script(
        "return [...document.querySelectorAll('#attention td[data-weight]')].map(td => "
        "[+td.dataset.query, +td.dataset.key, +td.dataset.weight]);")
    expected = attention_patterns(qk, LAYER)[HEAD]
    assert len(weights) == expected.numel()
    got = torch.zeros_like(expected)
    for q, k, w in weights:
        got[q, k] = w
    assert (got - expected).abs().max() < 1e-5
    _shot(driver, "attention-view", "attention")

    # SAE features: click the last token; its top features are the API's at that position.
    entry = api.sae_features[0]
    position = entry["positions"][-1].item()
    driver.find_element(By.CSS_SELECTOR, f"#sae-tokens span[data-position='{position}']").click()
    _wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#sae-top li"), 30)
    shown = driver.execute_script(
        "return [...document.querySelectorAll('#sae-top li')].map(li => "
        "[+li.dataset.feature, +li.dataset.value, li.textContent]);")
    indices, values = entry["indices"][-1], entry["values"][-1]
    active = [(int(i), float(v)) for i, v in zip(indices.tolist(), values.tolist()) if i >= 0]
    assert [(f, pytest.approx(v, rel=1e-6)) for f, v, _ in shown] == active
    labelled = next((f, text) for f, _, text in shown if f % 2 == 0)  # even features have labels
    assert labelled[1].endswith(entry["labels"][labelled[0]])
    # Click the second feature: every token is coloured by its value where it is in the top 32.
    feature = shown[1][0]
    driver.find_elements(By.CSS_SELECTOR, "#sae-top li")[1].click()
    spans = driver.execute_script(
        "return [...document.querySelectorAll('#sae-tokens span')].map(s => "
        "[+s.dataset.position, s.dataset.value]);")
    for row, (pos, value) in enumerate(spans):
        assert pos == entry["positions"][row].item()
        hit = (entry["indices"][row] == feature).nonzero()
        if len(hit):
            assert float(value) == pytest.approx(entry["values"][row, hit[0, 0]].item(), rel=1e-6)
        else:
            assert value == ""
    _shot(driver, "sae-view", "sae_features")

    # Steering by that feature: move the slider two steps (8 -> 9), wait for the answers.
    assert driver.find_element(By.ID, "steer-feature").get_attribute("value") == str(feature)
    slider = driver.find_element(By.ID, "steer-scale")
    slider.send_keys(Keys.ARROW_RIGHT, Keys.ARROW_RIGHT)
    _wait(driver, lambda d: (_state(d, "lensState.steer") or {}).get("scale") == 9.0
          and d.find_element(By.ID, "steer-steered").text not in ("", "…"))
    steer = _state(driver, "lensState.steer")
    assert steer["item"] == {"sae": "smol-l10", "feature": feature, "scale": 9.0}
    with LensClient(base) as client:
        plain = client.generate(PROMPT, max_tokens=steer["maxTokens"], temperature=0)
        steered = client.generate(PROMPT, max_tokens=steer["maxTokens"], temperature=0,
                                  steering_vectors=[steer["item"]])
    assert steer["plain"] == plain.text and steer["steered"] == steered.text
    assert driver.find_element(By.ID, "steer-steered").get_attribute("textContent") == steered.text
    _shot(driver, "steer-view", "steering")

    # A preset, as the operator registered it.
    Select(driver.find_element(By.ID, "steer-kind")).select_by_value("preset")
    Select(driver.find_element(By.ID, "steer-preset")).select_by_value("calm")
    driver.find_element(By.ID, "steer-run").click()
    _wait(driver, lambda d: (_state(d, "lensState.steer") or {}).get("item") == "preset:calm")
    with LensClient(base) as client:
        preset = client.generate(PROMPT, max_tokens=steer["maxTokens"], temperature=0,
                                 steering_vectors=["preset:calm"])
    assert _state(driver, "lensState.steer.steered") == preset.text

    # Everything the page loaded came from the server.
    requested = [json.loads(entry["message"])["message"] for entry in driver.get_log("performance")]
    urls = [m["params"]["request"]["url"] for m in requested
            if m.get("method") == "Network.requestWillBeSent"]
    assert urls and all(u.startswith(base) or u.startswith("data:") for u in urls), urls
    assert {u.removeprefix(base) for u in urls} >= {"/lens", "/lens/lens.js", "/lens/lens.css",
                                                    "/v1/completions", "/detokenize"}


def test_lens_page_errors_are_the_apis_and_the_page_forbids_other_origins(smol_server, browser):
    """A request the API refuses is shown with the API's message (the page adds no route that
    could do otherwise); the page's answers carry a policy that loads nothing from elsewhere."""
    base = smol_server.base_url
    page = httpx.get(f"{base}/lens")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    assert httpx.get(f"{base}/lens/other.js").status_code == 404
    driver = browser
    driver.get(f"{base}/lens")
    _wait(driver, lambda d: "layers" in d.find_element(By.ID, "model").text, 60)
    layers = driver.find_element(By.ID, "layers")
    layers.clear()
    layers.send_keys("40")  # SmolLM2 has layers 0..29
    driver.find_element(By.ID, "run").click()
    WebDriverWait(driver, 120).until(lambda d: d.find_element(By.ID, "error").text)
    message = driver.find_element(By.ID, "error").text
    assert "HTTP 400" in message and "apply_hooks" in message and "0..29" in message, message
    _shot(driver, "error", "refused")
