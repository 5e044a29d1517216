"""Write assets/corpus/lighthouse.txt: short tales of lighthouse keepers, generated
deterministically from a small grammar (seeded), so the corpus is reproducible and free of
any copyright (dedicated to the public domain, CC0).

    python assets/corpus/make_corpus.py            # rewrites lighthouse.txt (same bytes)

The text is plain English with a vocabulary of a few hundred words: small enough that the
reference TransformerLM learns its spelling and phrasing in a few minutes on a CPU.
"""

from __future__ import annotations

import os
import random

SEED = 1822  # the year of Fresnel's lens
TARGET_BYTES = 160_000

NAMES = ["Ada", "Tom", "Mary", "John", "Ruth", "Peter", "Nell", "Owen", "Grace", "Silas",
         "Martha", "Eli", "Hannah", "Jonas", "Agnes", "Caleb"]
PLACES = ["the north cape", "the harbour rock", "the long reef", "the grey point",
          "the island of gulls", "the old pier", "the south head", "the black shoal"]
TIMES = ["at dawn", "at dusk", "before the storm", "after midnight", "in the early morning",
         "late in the evening", "when the tide turned", "at the change of the watch"]
WEATHER = ["The sea was calm", "The wind rose from the west", "A thick fog rolled in",
           "Rain beat against the glass", "The sky was clear and full of stars",
           "Snow fell on the rocks", "A cold wind came from the north",
           "The waves were high and white"]
TASKS = ["trimmed the wick", "polished the lens", "wound the clock", "filled the lamp with oil",
         "wrote in the log book", "cleaned the brass", "carried coal up the stairs",
         "checked the weather glass", "mended the shutter", "lit the great lamp"]
SHIPS = ["a fishing boat", "a small schooner", "the mail steamer", "a coal barge",
         "a tall ship", "the pilot boat", "a lost rowing boat", "a ferry"]
FEELINGS = ["tired", "happy", "worried", "calm", "cold", "proud", "lonely", "hopeful"]
OBJECTS = ["an old map", "a brass key", "a letter", "a lantern", "a wooden box", "a spyglass",
           "a bundle of rope", "a loaf of bread"]
ANIMALS = ["a gull", "a seal", "a crab", "a black cat", "a heron", "an old dog"]
COLOURS = ["red", "green", "white", "grey", "blue", "golden"]


def sentence(r: random.Random, who: str, where: str) -> str:
    forms = [
        lambda: f"{who} {r.choice(TASKS)} {r.choice(TIMES)}.",
        lambda: f"{r.choice(WEATHER)}, and {who} {r.choice(TASKS)}.",
        lambda: f"{r.choice(WEATHER)} {r.choice(TIMES)}.",
        lambda: f"From the gallery {who} saw {r.choice(SHIPS)} near {r.choice(PLACES)}.",
        lambda: f"{who} felt {r.choice(FEELINGS)}, but the light had to burn all night.",
        lambda: f"On the stairs {who} found {r.choice(OBJECTS)}.",
        lambda: f"{r.choice(ANIMALS).capitalize()} sat on the wall and watched {who}.",
        lambda: f"The {r.choice(COLOURS)} light turned slowly above {where}.",
        lambda: f"\"Keep the lamp bright,\" said {r.choice(NAMES)}, \"and the ships will find the way.\"",
        lambda: f"{who} counted the flashes: one, two, three, and then the dark.",
        lambda: f"When {r.choice(SHIPS)} passed, {who} rang the bell {r.choice(['twice', 'three times', 'once'])}.",
        lambda: "{} {}, then {}.".format(who, *r.sample(TASKS, 2)),
        lambda: f"The log book says that {r.choice(SHIPS)} came home safe {r.choice(TIMES)}.",
    ]
    return r.choice(forms)()


def tale(r: random.Random, n: int) -> str:
    who = r.choice(NAMES)
    where = r.choice(PLACES)
    place = " ".join(w if w == "of" else w.capitalize() for w in where.removeprefix("the ").split())
    title = f"{n}. {who} of {place}"
    lines = [title, "", f"{who} kept the light on {where}."]
    for _ in range(r.randint(5, 10)):
        lines[-1] += " " + sentence(r, who, where)
    lines.append("")
    ending = r.choice([f"And so the light on {where} never went out.",
                       f"In the morning {who} slept, and the sea was quiet.",
                       f"That was the last winter {who} kept the light.",
                       f"{who} wrote one more line in the log book and closed it."])
    lines.append(ending)
    return "\n".join(lines)


def make(target: int = TARGET_BYTES, seed: int = SEED) -> str:
    r = random.Random(seed)
    tales, size, n = [], 0, 1
    while size < target:
        t = tale(r, n)
        tales.append(t)
        size += len(t) + 2
        n += 1
    return "\n\n".join(tales) + "\n"


if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "lighthouse.txt")
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(make())
    os.replace(tmp, path)
    print(path)
