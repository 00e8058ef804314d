"""An Inspect eval whose scorer reads the model's activations: a sentiment probe on SmolLM2.

    python examples/inspect_probe_eval.py [--layer 20] [--base-url http://127.0.0.1:8000/v1]

1. Fit: through the ``vllm-lens`` provider, capture the mean residual stream after one layer
   (over the prompt's positions but the first, the attention sink: ``"prompt[1:]"``) for a few
   labelled sentences; the probe direction is mean(positive) - mean(negative), its threshold
   the midpoint of the two means.
2. Eval: an Inspect task over held-out sentences; the solver generates with the same capture
   request, and the scorer projects each sample's activations on the direction and marks it
   correct when the side of the threshold matches the label.

Without ``--base-url`` the provider starts vLLM's OpenAI server itself (CPU-friendly settings)
and stops it at exit. Prints the accuracy and where the eval log went.
"""

from __future__ import annotations

import argparse
import asyncio

import torch
from inspect_ai import Task, eval
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessageUser, GenerateConfig, Model, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate

from vllm_lens.demo_models import smollm2_dir

TRAIN = [
    ("I love this, it made my whole day wonderful.", "positive"),
    ("What a delightful and happy surprise!", "positive"),
    ("The food was excellent and the staff were kind.", "positive"),
    ("This is the worst experience I have ever had.", "negative"),
    ("I feel miserable, everything went wrong today.", "negative"),
    ("The film was boring and the ending was awful.", "negative"),
]
TEST = [
    ("Such a beautiful morning, I am so grateful.", "positive"),
    ("Fantastic work, I am really proud of you.", "positive"),
    ("The concert was joyful and full of energy.", "positive"),
    ("I hate waiting in this terrible queue.", "negative"),
    ("My phone broke and I lost all my photos.", "negative"),
    ("The service was rude and the room was dirty.", "negative"),
]
CPU_SERVER_ARGS = {"dtype": "float32", "max_model_len": 1024,
                   "kv_cache_memory_bytes": 256 << 20, "timeout": 900}


def capture_request(layer: int) -> dict:
    return {"output_residual_stream": {"layers": [layer], "positions": "prompt[1:]",
                                       "reduce": "mean"}}


async def mean_activation(model: Model, text: str, layer: int) -> torch.Tensor:
    config = GenerateConfig(max_tokens=1, temperature=0,
                            extra_body={"extra_args": capture_request(layer)})
    output = await model.generate([ChatMessageUser(content=text)], config=config)
    return output.metadata["activations"]["residual_stream"][0]  # [hidden]


async def fit_probe(model: Model, layer: int) -> tuple[torch.Tensor, float]:
    acts = await asyncio.gather(*(mean_activation(model, text, layer) for text, _ in TRAIN))
    pos = torch.stack([a for a, (_, y) in zip(acts, TRAIN) if y == "positive"]).mean(0)
    neg = torch.stack([a for a, (_, y) in zip(acts, TRAIN) if y == "negative"]).mean(0)
    direction = pos - neg
    threshold = float((pos + neg) @ direction / 2)
    return direction, threshold


@scorer(metrics=[accuracy()])
def probe_scorer(direction: torch.Tensor, threshold: float):
    """Correct when the activations fall on the label's side of the probe's threshold."""

    async def score(state: TaskState, target: Target) -> Score:
        acts = state.output.metadata["activations"]["residual_stream"][0]
        projection = float(acts @ direction)
        predicted = "positive" if projection > threshold else "negative"
        return Score(value=CORRECT if predicted == target.text else INCORRECT,
                     answer=predicted, explanation=f"projection {projection:.2f} "
                     f"(threshold {threshold:.2f})")

    return score


def probe_task(direction: torch.Tensor, threshold: float, layer: int) -> Task:
    return Task(
        dataset=[Sample(input=text, target=label) for text, label in TEST],
        solver=generate(),
        scorer=probe_scorer(direction, threshold),
        config=GenerateConfig(max_tokens=8, temperature=0,
                              extra_body={"extra_args": capture_request(layer)}),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layer", type=int, default=20, help="decoder layer to probe")
    parser.add_argument("--base-url", default=None,
                        help="a running lens-enabled server (default: start one)")
    parser.add_argument("--log-dir", default="logs", help="where Inspect writes the eval log")
    args = parser.parse_args()

    model_args = {"base_url": args.base_url} if args.base_url else CPU_SERVER_ARGS
    with get_model(f"vllm-lens/{smollm2_dir()}", **model_args) as model:
        direction, threshold = asyncio.run(fit_probe(model, args.layer))
        (log,) = eval(probe_task(direction, threshold, args.layer), model=model,
                      log_dir=args.log_dir, display="none")
    metric = log.results.scores[0].metrics["accuracy"].value
    print(f"probe on layer {args.layer}: accuracy {metric:.2f} on {len(TEST)} held-out "
          f"sentences; eval log: {log.location}")


if __name__ == "__main__":
    main()
