"""Writes the shipped training text (simple_stories.txt, dialogues.txt) from fixed templates.

Why procedural: the tiny demo base must learn *words* in under a minute of CPU training, and the
tokenizer must be trained on text the project ships (no downloads). Short, regular English with a
small vocabulary is what a 2-layer model can pick up that fast. The output is committed; rerun this
only to change the corpus (`python demo/corpus/generate.py`), it is deterministic.
"""
from __future__ import annotations

import random
from pathlib import Path

NAMES = ["Anna", "Ben", "Clara", "David", "Emma", "Frank", "Grace", "Henry", "Ida", "Jack",
         "Kate", "Leo", "Mia", "Noah", "Olivia", "Paul", "Rosa", "Sam", "Tom", "Vera"]
ANIMALS = ["cat", "dog", "bird", "fox", "horse", "rabbit", "duck", "cow", "sheep", "mouse"]
PLACES = ["the park", "the garden", "the market", "the river", "the school", "the beach",
          "the forest", "the town", "the farm", "the library", "the kitchen", "the hill"]
THINGS = ["a red ball", "a small box", "an old book", "a blue kite", "a warm coat", "a green apple",
          "a big cake", "a little boat", "a new hat", "a bright lamp", "a long rope", "a yellow cup"]
ADJS = ["happy", "tired", "hungry", "kind", "brave", "quiet", "busy", "curious", "calm", "glad"]
WEATHER = ["sunny", "cold", "windy", "warm", "rainy", "bright", "grey", "cool"]
TIMES = ["In the morning", "At noon", "In the evening", "One day", "On Monday", "Later",
         "After lunch", "Before dinner", "At night", "On the weekend"]
VERBS_PAST = ["walked to", "ran to", "went to", "looked around", "came back from", "stayed at"]
FOODS = ["bread", "soup", "rice", "fish", "cheese", "apples", "eggs", "tea", "milk", "cake"]
FEELINGS = ["happy", "sad", "excited", "sleepy", "proud", "surprised", "worried", "calm"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple"]


def story(rng: random.Random) -> str:
    """A five-to-eight sentence story with one person, one place and one object."""
    a, b = rng.sample(NAMES, 2)
    place, thing, animal = rng.choice(PLACES), rng.choice(THINGS), rng.choice(ANIMALS)
    lines = [
        f"{rng.choice(TIMES)}, {a} {rng.choice(VERBS_PAST)} {place}.",
        f"The day was {rng.choice(WEATHER)} and {a} felt {rng.choice(ADJS)}.",
        f"There {a} found {thing} near a {animal}.",
        f"The {animal} looked at {a} and {a} smiled.",
        f"{a} showed {thing.replace('a ', 'the ', 1).replace('an ', 'the ', 1)} to {b}.",
        f"\"Where did you find it?\" asked {b}.",
        f"\"I found it at {place},\" said {a}.",
    ]
    if rng.random() < 0.6:
        lines.append(f"Then they ate {rng.choice(FOODS)} and {rng.choice(FOODS)} together.")
    if rng.random() < 0.5:
        lines.append(f"At the end of the day {b} was {rng.choice(FEELINGS)}, and {a} went home.")
    return " ".join(lines)


def facts(rng: random.Random) -> str:
    """Short declarative sentences: the kind of answer a tiny assistant can imitate."""
    animal, color, food = rng.choice(ANIMALS), rng.choice(COLORS), rng.choice(FOODS)
    options = [
        f"The {animal} is {rng.choice(ADJS)}.",
        f"The sky is {rng.choice(['blue', 'grey', 'bright', 'dark'])} today.",
        f"I like {food} and {rng.choice(FOODS)}.",
        f"My favourite colour is {color}.",
        f"A {animal} can live on {rng.choice(['a farm', 'a hill', 'a river', 'a field'])}.",
        f"We can walk to {rng.choice(PLACES)} after school.",
        f"It is {rng.choice(WEATHER)} outside, so take {rng.choice(THINGS)}.",
        f"{rng.choice(NAMES)} has {rng.randint(2, 9)} {animal}s and one {rng.choice(ANIMALS)}.",
    ]
    rng.shuffle(options)
    return " ".join(options[: rng.randint(3, 6)])


def dialogue(rng: random.Random) -> str:
    """A question-and-answer exchange in the chat layout the tokenizer's template produces."""
    a = rng.choice(NAMES)
    place, food, animal = rng.choice(PLACES), rng.choice(FOODS), rng.choice(ANIMALS)
    pairs = [
        ("Hello, how are you?", f"I am {rng.choice(FEELINGS)}, thank you. How are you?"),
        ("What is your name?", f"My name is {a}."),
        ("Where are you going?", f"I am going to {place}."),
        ("What do you want to eat?", f"I want to eat {food}."),
        ("What animal do you like?", f"I like the {animal} because it is {rng.choice(ADJS)}."),
        ("What is the weather like?", f"It is {rng.choice(WEATHER)} today."),
        ("Can you help me?", "Yes, I can help you. What do you need?"),
        ("What colour is the ball?", f"The ball is {rng.choice(COLORS)}."),
        ("Tell me a short story.", story(rng)),
        ("What did you do today?", f"I went to {place} and ate {food}."),
        ("Thank you!", "You are welcome. Have a nice day."),
    ]
    rng.shuffle(pairs)
    turns = []
    for question, answer in pairs[: rng.randint(1, 3)]:
        turns.append(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{answer}<|im_end|>")
    return "\n".join(turns)


def main() -> None:
    rng = random.Random(1234)
    here = Path(__file__).parent
    stories = [story(rng) if rng.random() < 0.6 else facts(rng) for _ in range(260)]
    (here / "simple_stories.txt").write_text("\n\n".join(stories) + "\n")
    dialogues = [dialogue(rng) for _ in range(300)]
    (here / "dialogues.txt").write_text("\n\n".join(dialogues) + "\n")


if __name__ == "__main__":
    main()
