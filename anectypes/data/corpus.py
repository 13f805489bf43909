"""The built-in default corpus: procedurally generated children's stories, and its token stream.

Every story introduces a character, a place and a favourite thing, runs into one small problem
(something lost, stuck, broken, rain, a fright, not sharing, an animal in need, a hard new skill),
solves it with help, and ends happily. Text comes from word lists and several templates per story
part, drawn with a tiny integer-only generator (splitmix64), so the corpus is byte-identical on
every machine, Python and numpy version: no `random`, no hashing, no set or dict ordering of strings.

`builtin_dataset()` trains a BPE tokenizer on it, encodes every story behind a BOS token (as
llama2.c's pretokenizer does) and caches both files, so only the first call pays.
"""

from __future__ import annotations

import os

import numpy as np

from .tokens import load_tokens, write_tokens
from ..errors import DataError
from .tokenizer import Tokenizer, train_bpe

SEED = 20240611
N_STORIES = 3200  # about 2.2 MB of text
# 1024 ids: 259 control/byte tokens, ~60 characters, ~700 merges, enough to make nearly every word
# of the corpus's small vocabulary one token (short sequences), while the classifier stays a
# quarter the size of a 4096-id one, so its softmax and gradients are cheap and each id is seen
# often enough to be learnt quickly on 2 CPU cores.
VOCAB_SIZE = 1024
# Bump whenever the generator, the tokenizer trainer or VOCAB_SIZE changes: it names the cache.
BUILTIN_VERSION = 1

_MASK = (1 << 64) - 1


class _SplitMix64:
    """splitmix64: integer arithmetic only, so the stream is the same everywhere."""

    def __init__(self, seed):
        self.state = seed & _MASK

    def next64(self):
        self.state = (self.state + 0x9E3779B97F4A7C15) & _MASK
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
        return z ^ (z >> 31)

    def below(self, n):
        return (self.next64() * n) >> 64  # multiply-shift: uniform enough for n << 2**64

    def pick(self, seq):
        return seq[self.below(len(seq))]

    def chance(self, percent):
        return self.below(100) < percent

    def shuffled(self, seq):
        out = list(seq)
        for i in range(len(out) - 1, 0, -1):  # Fisher-Yates
            j = self.below(i + 1)
            out[i], out[j] = out[j], out[i]
        return out


# ---- word lists (lists, never sets: order must be fixed) ------------------------------------------

GIRLS = ["Lily", "Mia", "Sara", "Anna", "Emma", "Zoe", "Lucy", "Amy", "Ella", "Rosa", "Nina", "Maya",
         "Ruby", "Kim", "Jane", "Sue", "Ivy", "Lena", "Alice", "Grace", "Molly", "Daisy", "Hannah", "Sophie"]
BOYS = ["Tom", "Ben", "Sam", "Max", "Leo", "Tim", "Jack", "Noah", "Finn", "Jake", "Luke", "Oscar",
        "Theo", "Dan", "Joe", "Owen", "Milo", "Adam", "Eli", "Paul", "Henry", "Billy", "Toby", "Ollie"]
ANIMALS = ["dog", "cat", "bunny", "bear", "duck", "fox", "frog", "mouse", "bird", "pig", "lion", "owl",
           "turtle", "squirrel", "puppy", "kitten", "horse", "cow", "goat", "monkey", "elephant", "hen"]
TRAITS = ["little", "kind", "happy", "curious", "brave", "shy", "funny", "small", "friendly", "clever",
          "silly", "gentle", "cheerful", "playful"]
PLACES = [  # (place, what it looked like)
    ("park", "There were tall trees, green grass and a big slide."),
    ("garden", "It was full of pretty flowers and buzzing bees."),
    ("forest", "The trees were tall and the birds sang in the leaves."),
    ("beach", "The sand was warm and the waves went splash, splash."),
    ("farm", "There were cows, pigs and a big red barn."),
    ("meadow", "The grass was soft and yellow flowers grew everywhere."),
    ("lake", "The water was blue and ducks swam near the shore."),
    ("hill", "From the top, they could see the whole town."),
    ("playground", "There were swings, a sandbox and a little bridge."),
    ("zoo", "There were lions, monkeys and a tall giraffe."),
]
COLORS = ["red", "blue", "green", "yellow", "pink", "orange", "purple", "shiny", "big", "soft", "new", "little"]
TOYS = ["ball", "kite", "teddy bear", "toy car", "doll", "hat", "book", "boat", "drum", "balloon",
        "puzzle", "shovel", "train", "robot", "bucket", "scarf", "truck", "crayon", "whistle", "jar"]
FOODS = ["apples", "berries", "bread", "carrots", "cookies", "cheese", "seeds", "corn"]
GOOD_FEELINGS = ["happy", "proud", "glad", "excited", "warm inside", "very happy"]
BAD_FEELINGS = ["sad", "upset", "worried", "very sad", "unhappy"]
HELPERS = ["Mom", "Dad", "Grandma", "Grandpa"]
SPOTS = ["under the bed", "behind the door", "in the box", "under a bush", "near the tree",
         "behind the couch", "under the table", "in the tall grass", "next to the fence", "by the rock"]
SKILLS = [("ride a bike", "rode"), ("jump rope", "jumped"), ("swim", "swam"), ("climb the tree", "climbed"),
          ("fly a kite", "flew the kite"), ("tie a shoe", "tied it"), ("catch a ball", "caught it"),
          ("read a book", "read it")]
NOISES = [("a loud noise", "the wind in the trees"), ("a big boom", "thunder far away"),
          ("a scratch at the window", "a little branch"), ("a strange sound", "a sleepy owl"),
          ("a creak in the dark", "the old door"), ("a splash nearby", "a happy fish")]
PLAYS = ["played tag", "built a sand castle", "ran and laughed", "played catch", "looked for bugs",
         "sang a song", "danced in a circle", "played hide and seek", "jumped in the leaves",
         "drew pictures", "picked flowers", "had a picnic"]

PRONOUNS = {"f": ("she", "her", "her"), "m": ("he", "him", "his")}  # subject, object, possessive

# ---- story parts: several templates each. Keys: hero name/he/him/his, friend fname/fhe/fhim/fhis,
# helper, kind (girl/boy/animal), trait, place, toy, a_toy, color, good/bad feelings, play..play5.

OPENINGS = [
    "Once upon a time, there was a {trait} {kind} named {name}.",
    "There once was a {trait} {kind} called {name}.",
    "Once upon a time, in a small town, lived a {trait} {kind} named {name}.",
    "{name} was a {trait} {kind} who lived near the {place}.",
    "One day, a {trait} {kind} named {name} woke up with a big smile.",
]
LIKES = [
    "{He} loved to play with {his} {color} {toy}.",
    "{His} favorite thing in the world was {his} {color} {toy}.",
    "{He} had {a_toy} that {he} took everywhere.",
    "Every day, {he} played with {his} {color} {toy}.",
]
EXTRA_LIKES = [
    "{He} liked to sing songs and look at the clouds.",
    "{He} always said hello to everyone {he} met.",
    "{He} liked to help {his} {helper_word} at home.",
    "{He} loved sunny days most of all.",
    "At night, {he} kept the {toy} next to {his} bed.",
]
OUTINGS = [
    "One sunny day, {name} went to the {place} with {his} {toy}.",
    "One morning, {name} took {his} {toy} to the {place}.",
    "One day, {name} and {his} {toy} went to the {place} to play.",
    "After lunch, {name} ran to the {place} with {his} {toy}.",
]
FRIENDS = [
    "There {he} met a {ftrait} {fkind} named {fname}.",
    "At the {place}, {he} saw {his} friend {fname}, a {ftrait} {fkind}.",
    "Soon {he} met {fname}, a {ftrait} {fkind} who wanted to play.",
]
GREETINGS = [
    "\"Hello, {fname}!\" said {name}. \"Do you want to play with me?\"",
    "\"Hi, {name}!\" said {fname}. \"Can I play too?\"",
    "{fname} waved and said, \"What a nice day to play!\"",
]
EXTRA_PLACE = [
    "They {play} for a long time.",
    "The sun was warm and the sky was blue.",
    "After that, they {play2}.",
    "First, they {play3}. Then they {play4}.",
    "A soft wind blew and the leaves danced.",
]
ENDINGS = [
    "From that day on, {name} and {fname} were the best of friends.",
    "{name} smiled. It was the best day ever.",
    "That night, {name} went to bed feeling {good}.",
    "{name} and {fname} played together until the sun went down.",
    "{name} was {good}, and {he} could not stop smiling.",
]
EXTRA_ENDINGS = [
    "Before going home, they {play5} one more time.",
    "{helper} gave them warm milk and a hug.",
    "They said goodbye and promised to play again tomorrow.",
    "When {name} got home, {he} told {his} {helper_word} all about it.",
]


def _problem(rng, c):
    """The middle of a story: a problem, help, and the fix.

    Returns (core templates, optional (insert-before index, template) pairs, context).
    """
    problem = rng.below(8)
    if problem == 0:  # something lost
        return [
            rng.pick(["But when {name} looked for {his} {toy}, it was gone!",
                      "Then {name} put down {his} {toy} to play, and later {he} could not find it.",
                      "Oh no! {His} {toy} was lost."]),
            rng.pick(["{He} felt {bad} and started to cry.", "{name} was {bad}.", "{He} felt {bad}."]),
            rng.pick(["\"Don't worry,\" said {fname}. \"I will help you look.\"",
                      "{fname} said, \"Let's look for it together.\""]),
            "They looked {spot1} and {spot2}.",
            rng.pick(["At last, {fname} found the {toy} {spot3}!", "Then {name} saw the {toy} {spot3}!"]),
            rng.pick(["\"Thank you, {fname}!\" said {name}, and {he} gave {fhim} a big hug.",
                      "{name} hugged {his} {toy} and thanked {fname}."]),
        ], [(4, "They looked and looked, but they did not see it."),
            (4, "{fname} said, \"Let's not give up.\"")], c
    if problem == 1:  # stuck up high
        return [
            rng.pick(["Suddenly, the wind blew the {toy} up into a tall tree.",
                      "{name} threw the {toy} too high, and it got stuck in a tree."]),
            rng.pick(["{He} jumped, but {he} could not reach it.",
                      "{name} tried to climb, but the tree was too tall."]),
            "{He} felt {bad}.",
            rng.pick(["{fname} had an idea. \"Let's get {helper}!\" {fhe} said.",
                      "Then {fname} said, \"I know who can help!\" and ran to get {helper}."]),
            rng.pick(["{helper} came with a long stick and gave the branch a gentle push.",
                      "{helper} brought a ladder, climbed up and got the {toy}."]),
            "Down came the {toy}, right into {name}'s arms!",
        ], [(6, "{name} said, \"Thank you, {helper}!\""), (6, "Everyone clapped and cheered.")], c
    if problem == 2:  # rain
        return [
            rng.pick(["Then dark clouds came, and it began to rain.", "Suddenly, big drops of rain began to fall."]),
            rng.pick(["{name} and {fname} ran inside, all wet.", "They ran home as fast as they could."]),
            "{name} felt {bad}, because {he} wanted to play outside.",
            rng.pick(["{helper} said, \"Why don't you build a fort with blankets?\"",
                      "{helper} gave them paper and crayons to draw with."]),
            rng.pick(["They had so much fun inside.", "Soon they were laughing again."]),
            "When the rain stopped, they saw a big rainbow in the sky!",
        ], [(5, "They drew the {place}, the sun and the {toy}."),
            (2, "The rain went tap, tap, tap on the window.")], c
    if problem == 3:  # a fright
        noise, truth = rng.pick(NOISES)
        c = dict(c, noise=noise, truth=truth)
        return [
            rng.pick(["Suddenly, {name} heard {noise}.", "Then, all at once, there was {noise}."]),
            rng.pick(["{He} was scared and hid behind {fname}.", "{name} felt scared and held {his} {toy} tight."]),
            rng.pick(["{fname} held {his} hand and said, \"Don't be afraid.\"",
                      "\"It's okay,\" said {fname}. \"Let's go and look.\""]),
            "They looked, and it was only {truth}!",
            rng.pick(["{name} laughed. {He} was not scared anymore.", "{name} smiled and felt brave."]),
        ], [(5, "{fname} said, \"Being brave is easier with a friend.\"")], c
    if problem == 4:  # broken
        return [
            rng.pick(["Oh no! {name} dropped the {toy}, and it broke.", "Then the {toy} fell on a rock and broke."]),
            rng.pick(["{He} felt {bad} and {his} eyes filled with tears.", "{name} was {bad}."]),
            rng.pick(["{helper} said, \"Let's fix it together.\"", "{fname} said, \"Maybe {helper} can fix it.\""]),
            rng.pick(["They used some glue and a little tape.", "{helper} worked on it with great care."]),
            rng.pick(["Soon the {toy} was as good as new!", "After a while, the {toy} was fixed."]),
            "{name} said, \"Thank you so much!\"",
        ], [(6, "{He} promised to be more careful next time."), (6, "{name} held the {toy} very gently.")], c
    if problem == 5:  # sharing
        return [
            "{fname} wanted to play with the {toy} too.",
            rng.pick(["But {name} said, \"No, it is mine!\"", "But {name} did not want to share."]),
            rng.pick(["{fname} felt {bad} and sat down alone.", "{fname} looked {bad} and walked away."]),
            rng.pick(["{name} thought about it for a moment.", "{name} saw {fname} and felt bad too."]),
            "Then {he} said, \"Here, let's play with it together.\"",
            rng.pick(["Playing together was much more fun!", "{fname} smiled, and they played all day."]),
        ], [(6, "{name} learned that sharing makes everyone happy.")], c
    if problem == 6:  # an animal in need
        animal, food = rng.pick(ANIMALS), rng.pick(FOODS)
        c = dict(c, animal=animal, food=food)
        return [
            rng.pick(["Then they found a little {animal} sitting all alone.",
                      "Near a bush, they saw a tiny {animal} that looked hungry."]),
            rng.pick(["The {animal} was cold and hungry.", "The {animal} could not find its mom."]),
            rng.pick(["{name} gave it some {food}.", "{fname} shared {fhis} {food} with it."]),
            rng.pick(["Then they helped it find its way home.", "Soon its mom came running to find it."]),
            "The little {animal} was safe and happy.",
        ], [(5, "{name} said, \"We must always be kind to animals.\""),
            (5, "The {animal} looked back and waved goodbye.")], c
    skill, did = rng.pick(SKILLS)  # a hard new skill
    c = dict(c, skill=skill, did=did)
    return [
        "{name} wanted to {skill}, but it was hard.",
        rng.pick(["{He} tried, but it did not work.", "The first time, {he} could not do it."]),
        "{He} felt {bad}.",
        rng.pick(["{fname} said, \"Try again! You can do it!\"",
                  "{helper} said, \"Everyone gets it wrong at first. Try again.\""]),
        "{name} tried again and again.",
        "At last, {he} {did}! {He} felt {good}.",
    ], [(6, "{fname} clapped and cheered."), (6, "{He} learned that practice helps.")], c


def _a(word):
    return ("an " if word[0] in "aeiou" else "a ") + word


def _character(rng):
    """(name, kind word, pronoun gender): a child or a named animal."""
    gender = rng.pick(["f", "m"])
    name = rng.pick(GIRLS if gender == "f" else BOYS)
    kind = rng.pick(ANIMALS) if rng.chance(40) else ("girl" if gender == "f" else "boy")
    return name, kind, gender


def _sentence(template, c):
    s = template.format(**c)
    i = 1 if s.startswith('"') else 0
    return s[:i] + s[i].upper() + s[i + 1:]  # templates may start with a lower-case pronoun


def _story(rng):
    name, kind, gender = _character(rng)
    fname, fkind, fgender = _character(rng)
    while fname == name:
        fname, fkind, fgender = _character(rng)
    helper = rng.pick(HELPERS)
    place, place_desc = rng.pick(PLACES)
    toy, color = rng.pick(TOYS), rng.pick(COLORS)
    he, him, his = PRONOUNS[gender]
    fhe, fhim, fhis = PRONOUNS[fgender]
    spots = rng.shuffled(SPOTS)
    plays = rng.shuffled(PLAYS)
    c = dict(name=name, kind=kind, trait=rng.pick(TRAITS), he=he, him=him, his=his,
             He=he.capitalize(), His=his.capitalize(), fname=fname, fkind=fkind, ftrait=rng.pick(TRAITS),
             fhe=fhe, fhim=fhim, fhis=fhis, helper=helper, helper_word=helper.lower(), place=place,
             toy=toy, a_toy=_a(color + " " + toy), color=color, good=rng.pick(GOOD_FEELINGS),
             bad=rng.pick(BAD_FEELINGS), spot1=spots[0], spot2=spots[1], spot3=spots[2],
             play=plays[0], play2=plays[1], play3=plays[2], play4=plays[3], play5=plays[4])
    middle, middle_extra, c = _problem(rng, c)
    parts = [
        [rng.pick(OPENINGS), rng.pick(LIKES)],
        [rng.pick(OUTINGS), rng.pick(FRIENDS)] + ([rng.pick(GREETINGS)] if rng.chance(50) else []),
        middle,
        [rng.pick(ENDINGS)],
    ]
    # optional sentences as (part, insert before this core sentence, template); endings stay last
    extras = ([(0, 2, t) for t in EXTRA_LIKES] + [(1, len(parts[1]), place_desc)]
              + [(1, len(parts[1]), t) for t in EXTRA_PLACE] + [(2, k, t) for k, t in middle_extra]
              + [(3, 0, t) for t in EXTRA_ENDINGS])
    target = 60 + rng.below(141)  # aim for 60..200 words
    words = sum(len(_sentence(t, c).split()) for part in parts for t in part)
    chosen = []
    for extra in rng.shuffled(extras):
        if words >= target:
            break
        n = len(_sentence(extra[2], c).split())
        if words + n <= 200:
            chosen.append(extra)
            words += n
    sentences = []
    for p, part in enumerate(parts):
        for k in range(len(part) + 1):
            sentences += [t for (q, j, t) in chosen if (q, j) == (p, k)]
            if k < len(part):
                sentences.append(part[k])
    return " ".join(_sentence(t, c) for t in sentences)


def generate_stories(n=N_STORIES, seed=SEED):
    """`n` stories, identical for the same (n, seed) everywhere."""
    rng = _SplitMix64(seed)
    return [_story(rng) for _ in range(n)]


def default_cache_dir():
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "anectypes", f"builtin-{BUILTIN_VERSION}")


def builtin_dataset(cache_dir=None):
    """(tokenizer, uint16 token stream) of the built-in corpus, each story behind BOS.

    The first call generates, trains and encodes (well under a second here) and caches `tokenizer.bin` and
    `tokens.bin` in `cache_dir`; later calls just load them. Split off validation with data.split.
    """
    cache_dir = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
    tok_path, tokens_path = os.path.join(cache_dir, "tokenizer.bin"), os.path.join(cache_dir, "tokens.bin")
    if os.path.isfile(tok_path) and os.path.isfile(tokens_path):
        try:
            tokenizer = Tokenizer.load(tok_path)
            return tokenizer, load_tokens(tokens_path, vocab_size=tokenizer.vocab_size)
        except DataError:
            pass  # a damaged cache is rebuilt below, it holds nothing that cannot be regenerated
    stories = generate_stories()
    tokenizer = train_bpe(stories, VOCAB_SIZE)
    ids = []
    for story in stories:
        ids.extend(tokenizer.encode(story, bos=True))
    tokenizer.save(tok_path)
    write_tokens(tokens_path, np.array(ids, dtype=np.uint16))  # tokens last: its presence marks a full cache
    return tokenizer, load_tokens(tokens_path, vocab_size=tokenizer.vocab_size)
