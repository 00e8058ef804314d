"""PASTA on SmolLM2: emphasise one of two contradicting notes, and the answer follows it.

    python examples/pasta.py [--layers 16-23] [--alpha 0.01] [--max-tokens 12]

Each prompt holds two notes that contradict each other ("Note 1: The meeting is on Monday.
Note 2: Correction, the meeting is on Friday.") and a question. Every prompt is answered
greedily three times in one batch: plain, with note 1 emphasised, with note 2 emphasised.
Emphasis is ``steer_attention``'s PASTA form (Zhang et al., ICLR 2024): in every head of the
chosen layers, the attention to keys outside the note's tokens is multiplied by ``alpha`` and
each row renormalised. An answer follows a note when the note's value appears in it first.

The last line printed is a JSON summary: how many answers follow note 1, note 2 or neither,
for each of the three runs.
"""

from __future__ import annotations

import argparse
import json

#: (subject, note 1's value, note 2's value, question)
ITEMS = [
    ("the meeting", "on Monday", "on Friday", "On which day is the meeting?"),
    ("Anna's favourite colour", "green", "purple", "What is Anna's favourite colour?"),
    ("the capital of Zorbia", "Velmar", "Ostrak", "What is the capital of Zorbia?"),
    ("the password", "tiger", "falcon", "What is the password?"),
    ("Tom's pet", "a cat", "a parrot", "What pet does Tom have?"),
    ("the train's departure", "at noon", "at midnight", "When does the train leave?"),
    ("the winner of the race", "Maria", "Lucas", "Who won the race?"),
    ("the price of the lamp", "ten dollars", "forty dollars", "How much is the lamp?"),
    ("the hotel's city", "Lisbon", "Oslo", "In which city is the hotel?"),
    ("the cake's flavour", "lemon", "chocolate", "What flavour is the cake?"),
    ("the team's captain", "Priya", "Jonas", "Who is the team's captain?"),
    ("the concert's venue", "the park", "the stadium", "Where is the concert?"),
]


def note_spans(tokenizer, text: str, notes: list[str]) -> list[list[int]]:
    """``[start, end)`` token positions of each note in ``text`` (offsets from the fast
    tokenizer)."""
    offsets = tokenizer(text, return_offsets_mapping=True)["offset_mapping"]
    spans = []
    for note in notes:
        lo = text.index(note)
        hi = lo + len(note)
        inside = [i for i, (a, b) in enumerate(offsets) if a < hi and b > lo]
        spans.append([inside[0], inside[-1] + 1])
    return spans


def follows(answer: str, first: str, second: str) -> str:
    """``"1"``, ``"2"`` or ``"neither"``: whose value the answer names first."""
    text = answer.lower()
    a, b = text.find(first.lower()), text.find(second.lower())
    if a >= 0 and (b < 0 or a < b):
        return "1"
    return "2" if b >= 0 else "neither"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default="16-23", help="first-last layer (default 16-23)")
    parser.add_argument("--alpha", type=float, default=0.01,
                        help="factor on the attention to keys outside the note (default 0.01)")
    parser.add_argument("--max-tokens", type=int, default=12,
                        help="tokens generated per answer (default 12)")
    args = parser.parse_args()
    first, last = (int(x) for x in args.layers.split("-"))
    layers = list(range(first, last + 1))

    from vllm import LLM, SamplingParams

    from vllm_lens.demo_models import smollm2_dir

    llm = LLM(model=smollm2_dir(), dtype="float32", max_model_len=1024, enforce_eager=True,
              kv_cache_memory_bytes=512 << 20)
    tokenizer = llm.get_tokenizer()
    prompts, params, rows = [], [], []
    for subject, one, two, question in ITEMS:
        notes = [f"Note 1: {subject[0].upper()}{subject[1:]} is {one}.",
                 f"Note 2: Correction, {subject} is {two}."]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{notes[0]} {notes[1]}\n{question} Answer in one "
                                         "word."}],
            tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text)["input_ids"]
        spans = note_spans(tokenizer, text, notes)
        for span in (None, *spans):
            extra = None if span is None else {"steer_attention": [
                {"layers": layers, "heads": None, "emphasize": span, "alpha": args.alpha}]}
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                         extra_args=extra))
        rows.append((subject, one, two, spans))
    outputs = llm.generate(prompts, params, use_tqdm=False)

    runs = ("plain", "note 1 emphasised", "note 2 emphasised")
    summary = {run: {"1": 0, "2": 0, "neither": 0} for run in runs}
    for i, (subject, one, two, spans) in enumerate(rows):
        print(f"\n{subject}: note 1 says {one!r} (tokens {spans[0]}), note 2 {two!r} "
              f"(tokens {spans[1]})")
        for j, run in enumerate(runs):
            answer = outputs[3 * i + j].outputs[0].text.strip().replace("\n", " ")
            verdict = follows(answer, one, two)
            summary[run][verdict] += 1
            print(f"  {run:<18} follows {verdict:<7} {answer!r}")
    print(f"\nPASTA at layers {first}-{last}, alpha {args.alpha}:")
    for run in runs:
        counts = summary[run]
        print(f"  {run:<18} note 1: {counts['1']:>2}   note 2: {counts['2']:>2}   neither: "
              f"{counts['neither']:>2}   (of {len(ITEMS)})")
    print(json.dumps({"layers": [first, last], "alpha": args.alpha, "items": len(ITEMS),
                      "follows": summary}))


if __name__ == "__main__":
    main()
