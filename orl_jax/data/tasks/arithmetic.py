"""GSM8K-like multi-step arithmetic word problems with worked solutions.

Seven story families (a changing collection, shopping with change, production, travel, savings, classroom
supplies, ages), each with several phrasings, names, items and 2-5 arithmetic steps on small integers. Every
intermediate value is a non-negative integer (divisions are exact). The worked solution has one line per step
with the equation written as "a op b = c" (op one of + - * /), then "#### <answer>".

The split key is the family, its structure and its numbers (not the names or items), so a held-out problem
differs from every training problem in its arithmetic, not only in its wording.
"""

from __future__ import annotations

import random

from orl_jax.data.tasks.base import Example, Task, extract_final_answer, parse_int

NAMES = (
    "Ava", "Ben", "Chloe", "Diego", "Emma", "Farah", "Gabe", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mateo", "Nora",
    "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Wes", "Ximena", "Yusuf", "Zoe", "Leo", "Mia",
)
ITEMS = ("apples", "marbles", "stickers", "cookies", "pencils", "books", "shells", "cards", "stamps", "beads",
         "candies", "coins", "balloons", "crayons", "buttons")
CONTAINERS = ("bags", "boxes", "packs", "jars", "crates", "bundles")
GOODS = (("notebook", "notebooks"), ("pen", "pens"), ("sandwich", "sandwiches"), ("juice box", "juice boxes"),
         ("comic", "comics"), ("candle", "candles"), ("toy car", "toy cars"), ("mug", "mugs"), ("plant", "plants"),
         ("scarf", "scarves"), ("ticket", "tickets"), ("puzzle", "puzzles"))
PRODUCTS = (("bakery", "loaves of bread"), ("factory", "toy robots"), ("farm", "eggs"), ("workshop", "chairs"),
            ("print shop", "posters"), ("kitchen", "pies"))
VEHICLES = ("drives", "rides a bike", "sails", "flies a small plane")
SUPPLIES = ("markers", "glue sticks", "worksheets", "scissors", "paint brushes")
WANTS = ("bike", "game console", "telescope", "guitar", "tent", "skateboard")
SPENDS = ("a book", "a movie ticket", "a hat", "lunch", "a gift for a friend")
RELATIVES = ("brother", "sister", "cousin")

FORMAT_INSTRUCTION = 'Solve the problem step by step, then write the final answer on the last line as "#### <number>".'


def _eq(a: int, op: str, b: int) -> tuple[str, int]:
    c = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    if op == "/":
        assert a % b == 0, (a, b)
    return f"{a} {op} {b} = {c}", c


def _pronoun(name: str) -> str:
    return "she" if name in {"Ava", "Chloe", "Emma", "Farah", "Hana", "Jade", "Lena", "Nora", "Priya", "Rosa",
                             "Tara", "Vera", "Ximena", "Zoe", "Mia"} else "he"


# Each family returns (question, solution lines, answer, key) or None to redraw.

def _collection(rng: random.Random):
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    he = _pronoun(name)
    n = rng.randint(5, 40)
    intro = rng.choice([f"{name} has {n} {item}.", f"{name} starts the week with {n} {item}.",
                        f"There are {n} {item} in {name}'s collection."])
    sentences, lines, ops = [intro], [], []
    n_eq = rng.randint(2, 5)
    while len(lines) < n_eq:
        kind = rng.choice(["add", "sub", "groups", "mul", "share", "half"])
        if kind == "add":
            b = rng.randint(2, 30)
            sentences.append(rng.choice([f"Then {he} finds {b} more.", f"A friend gives {name} {b} more {item}.",
                                         f"{name} buys {b} more {item}."]))
            eq, n2 = _eq(n, "+", b)
            lines.append(f"After getting {b} more: {eq}.")
        elif kind == "sub":
            if n < 4:
                continue
            b = rng.randint(1, n - 1)
            sentences.append(rng.choice([f"{name} gives {b} {item} to a friend.", f"{name} loses {b} of them.",
                                         f"Then {he} uses {b} {item} for a project."]))
            eq, n2 = _eq(n, "-", b)
            lines.append(f"After losing {b}: {eq}.")
        elif kind == "groups":
            if len(lines) + 2 > n_eq:
                continue
            g, k, box = rng.randint(2, 6), rng.randint(2, 12), rng.choice(CONTAINERS)
            sentences.append(rng.choice([f"Next {he} buys {g} {box} with {k} {item} in each.",
                                         f"{name} receives {g} {box} of {item}, and each holds {k}."]))
            eq1, m = _eq(g, "*", k)
            eq, n2 = _eq(n, "+", m)
            lines.append(f"The {box} hold {eq1} {item}.")
            lines.append(f"Adding them: {eq}.")
        elif kind == "mul":
            if n > 150:
                continue
            f = rng.choice([2, 3])
            word = {2: "doubles", 3: "triples"}[f]
            sentences.append(rng.choice([f"Then the number of {item} {word}.",
                                         f"Over the month {name}'s pile {word}."]))
            eq, n2 = _eq(n, "*", f)
            lines.append(f"After it {word}: {eq}.")
        elif kind == "share":
            ks = [k for k in range(2, 7) if n % k == 0]
            if not ks:
                continue
            k = rng.choice(ks)
            sentences.append(f"{name} splits the {item} equally among {k} people, {name} included, "
                             f"and keeps one share.")
            eq, n2 = _eq(n, "/", k)
            lines.append(f"One of {k} equal shares: {eq}.")
        else:
            if n % 2 or n < 4:
                continue
            sentences.append(rng.choice([f"{name} gives away half of them.", f"Half of the {item} get lost."]))
            eq, n2 = _eq(n, "/", 2)
            lines.append(f"Half of them: {eq}.")
        ops.append((kind, n, n2))
        n = n2
    question = " ".join(sentences) + " " + rng.choice([f"How many {item} does {name} have now?",
                                                       f"How many {item} does {name} end up with?"])
    return question, lines, n, f"collection:{ops}"


def _shopping(rng: random.Random):
    name = rng.choice(NAMES)
    k = rng.choice([2, 2, 3])
    goods = rng.sample(GOODS, k)
    qty = [rng.randint(2, 9) for _ in goods]
    price = [rng.randint(1, 12) for _ in goods]
    parts, lines, costs = [], [], []
    for (_one, many), q, p in zip(goods, qty, price):
        parts.append(f"{q} {many} for ${p} each")
        eq, c = _eq(q, "*", p)
        lines.append(f"Cost of the {many}: {eq}.")
        costs.append(c)
    total = costs[0]
    for c in costs[1:]:
        eq, total2 = _eq(total, "+", c)
        lines.append(f"Total so far: {eq}.")
        total = total2
    buy = ", ".join(parts[:-1]) + f" and {parts[-1]}"
    if k == 2 and total < 100 and rng.random() < 0.6:
        bill = next(b for b in (20, 50, 100) if b > total)
        eq, change = _eq(bill, "-", total)
        lines.append(f"Change from the ${bill} bill: {eq}.")
        question = f"{name} buys {buy}. {name} pays with a ${bill} bill. How much change, in dollars, does " \
                   f"{name} get back?"
        return question, lines, change, f"shopping:change:{qty}:{price}:{bill}"
    question = rng.choice([f"{name} buys {buy}. How many dollars does {name} spend in total?",
                           f"At the market, {name} picks up {buy}. What is the total cost in dollars?"])
    return question, lines, total, f"shopping:total:{qty}:{price}"


def _production(rng: random.Random):
    place, product = rng.choice(PRODUCTS)
    r, h, d = rng.randint(3, 15), rng.randint(2, 8), rng.randint(2, 6)
    lines = []
    eq, per_day = _eq(r, "*", h)
    lines.append(f"Made per day: {eq}.")
    eq, total = _eq(per_day, "*", d)
    lines.append(f"Made in {d} days: {eq}.")
    question = f"A {place} makes {r} {product} every hour and works {h} hours a day. "
    mode = rng.choice(["sold", "boxes", "sold_boxes"])
    if mode == "sold":
        s = rng.randint(1, total - 1)
        eq, left = _eq(total, "-", s)
        lines.append(f"Left after selling {s}: {eq}.")
        question += f"Over {d} days it sells {s} of them. How many {product} are left?"
        return question, lines, left, f"production:sold:{r}:{h}:{d}:{s}"
    b = rng.choice([b for b in range(2, 11) if b < total])
    if mode == "boxes":
        if total % b:
            return None
        eq, boxes = _eq(total, "/", b)
        lines.append(f"Boxes of {b}: {eq}.")
        question += f"Everything made in {d} days is packed into boxes of {b}. How many boxes are filled?"
        return question, lines, boxes, f"production:boxes:{r}:{h}:{d}:{b}"
    s = total % b + b * rng.randint(0, max(0, (total - 1) // b - 1))
    if not 0 < s < total:
        return None
    eq, left = _eq(total, "-", s)
    lines.append(f"Left after selling {s}: {eq}.")
    eq, boxes = _eq(left, "/", b)
    lines.append(f"Boxes of {b}: {eq}.")
    question += (f"In {d} days it sells {s} of them and packs the rest into boxes of {b}. "
                 f"How many boxes does it fill?")
    return question, lines, boxes, f"production:sold_boxes:{r}:{h}:{d}:{s}:{b}"


def _travel(rng: random.Random):
    name, how = rng.choice(NAMES), rng.choice(VEHICLES)
    v1, t1, v2, t2 = rng.randint(5, 60), rng.randint(1, 5), rng.randint(5, 60), rng.randint(1, 5)
    lines = []
    eq, d1 = _eq(v1, "*", t1)
    lines.append(f"First part: {eq} km.")
    eq, d2 = _eq(v2, "*", t2)
    lines.append(f"Second part: {eq} km.")
    eq, d = _eq(d1, "+", d2)
    lines.append(f"Distance covered: {eq} km.")
    question = (f"{name} {how} at {v1} km per hour for {t1} hours, then at {v2} km per hour for {t2} hours. ")
    if rng.random() < 0.5:
        trip = d + rng.randint(5, 200)
        eq, left = _eq(trip, "-", d)
        lines.append(f"Still to go: {eq} km.")
        question += f"The whole trip is {trip} km. How many kilometers are left?"
        return question, lines, left, f"travel:left:{v1}:{t1}:{v2}:{t2}:{trip}"
    question += "How many kilometers does the trip cover?"
    return question, lines, d, f"travel:total:{v1}:{t1}:{v2}:{t2}"


def _savings(rng: random.Random):
    name = rng.choice(NAMES)
    he = _pronoun(name)
    w, n = rng.randint(3, 25), rng.randint(2, 10)
    lines = []
    eq, saved = _eq(w, "*", n)
    lines.append(f"Earned: {eq} dollars.")
    gift = rng.choice([0, rng.randint(5, 40)])
    text = f"{name} earns ${w} each week for {n} weeks."
    if gift:
        eq, saved = _eq(saved, "+", gift)
        lines.append(f"With the gift: {eq} dollars.")
        text += f" A relative also gives {name} ${gift}."
    s = rng.randint(1, saved - 1)
    eq, saved = _eq(saved, "-", s)
    lines.append(f"After spending {s}: {eq} dollars.")
    spend = rng.choice(SPENDS)
    want = rng.choice(WANTS)
    price = saved + rng.randint(1, 120)
    eq, need = _eq(price, "-", saved)
    lines.append(f"Still needed: {eq} dollars.")
    question = (f"{text} Then {he} spends ${s} on {spend}. {name} wants a {want} that costs ${price}. "
                f"How many more dollars does {name} need?")
    return question, lines, need, f"savings:{w}:{n}:{gift}:{s}:{price}"


def _classroom(rng: random.Random):
    c, s, g = rng.randint(2, 6), rng.randint(12, 30), rng.randint(2, 6)
    if (c * s) % g:
        return None
    m, supply = rng.randint(1, 6), rng.choice(SUPPLIES)
    lines = []
    eq, students = _eq(c, "*", s)
    lines.append(f"Students: {eq}.")
    eq, groups = _eq(students, "/", g)
    lines.append(f"Groups of {g}: {eq}.")
    eq, need = _eq(groups, "*", m)
    lines.append(f"{supply.capitalize()} needed: {eq}.")
    question = (f"A school has {c} classes with {s} students each. The teacher puts the students into groups of {g}, "
                f"and each group gets {m} {supply}. ")
    packs = [p for p in range(2, 13) if need % p == 0 and p < need]
    if packs and rng.random() < 0.5:
        p = rng.choice(packs)
        eq, n_packs = _eq(need, "/", p)
        lines.append(f"Packs of {p}: {eq}.")
        question += f"The {supply} come in packs of {p}. How many packs are needed?"
        return question, lines, n_packs, f"classroom:packs:{c}:{s}:{g}:{m}:{p}"
    question += f"How many {supply} are needed in all?"
    return question, lines, need, f"classroom:total:{c}:{s}:{g}:{m}"


def _ages(rng: random.Random):
    name, rel = rng.choice(NAMES), rng.choice(RELATIVES)
    a, d, m, y = rng.randint(3, 15), rng.randint(1, 9), rng.choice([2, 3]), rng.randint(2, 20)
    lines = []
    eq, b = _eq(a, "+", d)
    lines.append(f"The {rel}'s age: {eq}.")
    eq, mom = _eq(b, "*", m)
    lines.append(f"Their mother's age: {eq}.")
    times = {2: "twice", 3: "three times"}[m]
    question = (f"{name} is {a} years old. {name}'s {rel} is {d} years older. "
                f"Their mother is {times} as old as the {rel}. ")
    if rng.random() < 0.5:
        eq, future = _eq(mom, "+", y)
        lines.append(f"In {y} years: {eq}.")
        question += f"How old will the mother be in {y} years?"
        return question, lines, future, f"ages:future:{a}:{d}:{m}:{y}"
    eq, s1 = _eq(a, "+", b)
    lines.append(f"{name} and the {rel}: {eq}.")
    eq, s2 = _eq(s1, "+", mom)
    lines.append(f"All three: {eq}.")
    question += "What is the sum of the three ages?"
    return question, lines, s2, f"ages:sum:{a}:{d}:{m}"


FAMILIES = (_collection, _shopping, _production, _travel, _savings, _classroom, _ages)


class ArithmeticTask(Task):
    name = "arithmetic"

    def _draw(self, rng: random.Random):
        while True:
            out = rng.choice(FAMILIES)(rng)
            if out is not None:
                question, lines, answer, key = out
                return key, (question, lines, answer)

    def _build(self, draft) -> Example:
        question, lines, answer = draft
        solution = "\n".join(lines) + f"\n#### {answer}"
        return Example(prompt=f"{question}\n{FORMAT_INSTRUCTION}", solution=solution, answer=str(answer),
                       task=self.name)

    def verify(self, example: Example, response: str) -> bool:
        got = parse_int(extract_final_answer(response))
        return got is not None and got == int(example.answer)
