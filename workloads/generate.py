#!/usr/bin/env python3
"""Generate small, deterministic prompt workloads for TIDE.

Writes chat_en.jsonl, code.jsonl, math.jsonl and chat_fr.jsonl next to this
script. Each file holds exactly N_LINES distinct lines of the form
{"messages": [{"role": "user", "content": "..."}]}.

Standard library only; output is byte-identical across runs (seed 1234).
Usage (from the repo root): python3 workloads/generate.py
"""

import json
import os
import random

SEED = 1234
N_LINES = 400
OUT_DIR = os.path.dirname(os.path.abspath(__file__))


def build(rng, makers, n=N_LINES, max_tries=200000):
    """Draw prompts round-robin from `makers` (callables taking rng) until
    `n` distinct prompts are collected, then shuffle them with `rng`."""
    seen = set()
    out = []
    tries = 0
    i = 0
    while len(out) < n:
        tries += 1
        if tries > max_tries:
            raise RuntimeError("could not build %d distinct prompts (got %d)" % (n, len(out)))
        text = makers[i % len(makers)](rng).strip()
        i += 1
        if text not in seen:
            seen.add(text)
            out.append(text)
    rng.shuffle(out)
    return out


def write_jsonl(name, prompts):
    path = os.path.join(OUT_DIR, name)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for p in prompts:
            obj = {"messages": [{"role": "user", "content": p}]}
            f.write(json.dumps(obj, ensure_ascii=False) + "\n")
    return path


def T(template, **pools):
    """Return a maker that fills `template` with random choices from pools.
    A pool value may be a list (random.choice) or a callable taking rng."""
    keys = sorted(pools)

    def make(rng):
        vals = {}
        for k in keys:
            p = pools[k]
            vals[k] = p(rng) if callable(p) else rng.choice(p)
        return template.format(**vals)

    return make


def rint(lo, hi):
    return lambda rng: rng.randint(lo, hi)


# ---------------------------------------------------------------- chat_en
EN_TOPICS = ["photosynthesis", "inflation", "black holes", "the water cycle", "compound interest",
             "vaccines", "climate change", "the stock market", "plate tectonics", "machine learning",
             "the immune system", "blockchain", "jet lag", "the placebo effect", "supply and demand",
             "rainbows", "tides", "caffeine", "sleep cycles", "recycling", "credit scores", "the internet",
             "electric cars", "solar panels", "earthquakes", "the Roman Empire", "DNA", "gravity"]
EN_AUDIENCES = ["a 10-year-old", "a busy parent", "a high school student", "my grandmother",
                "someone with no science background", "a new employee"]
EN_SKILLS = ["cook rice on the stove", "change a flat bike tire", "start a vegetable garden",
             "unclog a kitchen sink", "iron a dress shirt", "make cold brew coffee", "tie a tie",
             "remove a red wine stain", "back up my phone", "meditate for beginners",
             "plan a weekly budget", "clean a cast iron pan", "learn touch typing",
             "repot a houseplant", "bake sourdough bread", "fold a fitted sheet",
             "set up a home Wi-Fi network", "write a cover letter", "prepare for a job interview",
             "train for a 5K run", "organize a small closet", "descale a kettle"]
EN_PROBLEMS = ["I can't fall asleep at night", "I procrastinate on big projects",
               "I feel nervous before public speaking", "I keep forgetting people's names",
               "my coworker takes credit for my work", "I spend too much on takeout",
               "I get distracted by my phone while studying", "I have trouble saying no to friends",
               "I'm moving to a new city and don't know anyone", "my houseplants keep dying",
               "I feel tired every afternoon", "my roommate is very messy",
               "I want to read more books but never find time", "I'm nervous about my first marathon"]
EN_WRITE = ["a short thank-you note to my neighbor who watered my plants",
            "a polite email asking my landlord to fix the heating",
            "a two-sentence birthday message for my coworker",
            "a short apology text for missing a friend's dinner",
            "a haiku about autumn leaves", "a limerick about a lazy cat",
            "a brief out-of-office reply for a week of vacation",
            "a product description for a handmade ceramic mug",
            "a short toast for my sister's wedding",
            "a friendly reminder email about an unpaid invoice",
            "a four-line poem about the ocean", "a one-paragraph bio for a freelance photographer",
            "a short message declining a meeting invitation",
            "a tweet announcing our bakery's new opening hours",
            "a short note welcoming a new team member",
            "a two-sentence review of a cozy cafe"]
EN_A = ["tea", "renting", "working from home", "a laptop", "taking the train", "a gas stove",
        "paper books", "a standing desk", "running outdoors", "a credit card", "a public library",
        "an e-reader", "a tablet", "a savings account", "a night shift", "online classes"]
EN_B = ["coffee", "buying a home", "working in an office", "a desktop computer", "driving",
        "an induction cooktop", "audiobooks", "a regular desk", "a treadmill", "a debit card",
        "buying books", "printed books", "a smartphone", "an index fund", "a day shift",
        "in-person classes"]
EN_PAIRS = list(zip(EN_A, EN_B))
EN_PLACES = ["Lisbon", "Kyoto", "Iceland", "Mexico City", "the Scottish Highlands", "Vancouver",
             "Rome", "Cape Town", "Seoul", "New Orleans", "Prague", "Bali"]
EN_DAYS = ["two", "three", "four", "five", "seven"]
EN_FOODS = ["chicken", "lentils", "tofu", "salmon", "chickpeas", "eggs", "mushrooms", "spinach",
            "sweet potatoes", "ground beef", "black beans", "zucchini"]
EN_WORDS = ["affect and effect", "its and it's", "fewer and less", "weather and whether",
            "principal and principle", "complement and compliment", "lie and lay",
            "further and farther", "imply and infer", "then and than"]
EN_HOBBIES = ["painting", "chess", "rock climbing", "knitting", "photography", "bird watching",
              "playing the guitar", "woodworking", "pottery", "learning Spanish", "yoga", "baking"]
EN_ITEMS = ["a winter coat", "running shoes", "a used car", "a mattress", "a laptop for school",
            "a coffee maker", "noise-cancelling headphones", "a bicycle", "a tent", "a blender"]
EN_FACTS = ["the sky is blue", "we have leap years", "onions make us cry", "cats purr",
            "ice floats on water", "we yawn", "leaves change color in the fall",
            "bread rises", "airplanes stay in the air", "the moon has phases",
            "our ears pop on planes", "popcorn pops"]
EN_BUDGETS = ["$20", "$50", "$100", "$30", "$75"]
EN_PEOPLE = ["my dad", "a coworker", "my best friend", "a teenager", "my teacher", "a coffee lover",
             "someone who loves hiking", "a new mom", "my boss"]
EN_MINUTES = ["10", "15", "20", "30"]

EN_MAKERS = [
    T("Can you explain {t} in simple terms?", t=EN_TOPICS),
    T("How would you explain {t} to {a}?", t=EN_TOPICS, a=EN_AUDIENCES),
    T("What are three common misconceptions about {t}?", t=EN_TOPICS),
    T("Give me a one-paragraph summary of {t}.", t=EN_TOPICS),
    T("How do I {s}? Please give step-by-step instructions.", s=EN_SKILLS),
    T("What's the easiest way to {s}?", s=EN_SKILLS),
    T("What mistakes do beginners make when they try to {s}?", s=EN_SKILLS),
    T("{p}. Do you have any advice?", p=EN_PROBLEMS),
    T("{p}. What would you suggest I try first?", p=EN_PROBLEMS),
    T("Please write {w}.", w=EN_WRITE),
    T("Could you help me write {w}? Keep it short.", w=EN_WRITE),
    T("What are the pros and cons of {ab[0]} versus {ab[1]}?", ab=EN_PAIRS),
    T("I'm trying to decide between {ab[0]} and {ab[1]}. What should I consider?", ab=EN_PAIRS),
    T("Can you suggest a {d}-day itinerary for {p}?", d=EN_DAYS, p=EN_PLACES),
    T("What should I pack for a {d}-day trip to {p}?", d=EN_DAYS, p=EN_PLACES),
    T("What's a quick dinner I can make with {fg[0]} and {fg[1]}?", fg=lambda rng: rng.sample(EN_FOODS, 2)),
    T("Give me a healthy lunch idea that uses {f}.", f=EN_FOODS),
    T("What's the difference between {w}?", w=EN_WORDS),
    T("How do I get started with {h} as an adult beginner?", h=EN_HOBBIES),
    T("I have {m} minutes a day. How can I make progress at {h}?", m=EN_MINUTES, h=EN_HOBBIES),
    T("What should I look for when buying {i}?", i=EN_ITEMS),
    T("Can you briefly explain why {f}?", f=EN_FACTS),
    T("Can you suggest a gift under {b} for {p}?", b=EN_BUDGETS, p=EN_PEOPLE),
    T("What are some good conversation starters with {p}?", p=EN_PEOPLE),
    T("Summarize the history of {t} in three sentences.", t=["the printing press", "the bicycle",
      "coffee", "the Olympic Games", "chess", "the telephone", "jazz", "paper money",
      "the lightbulb", "pizza", "the calendar", "vaccination"]),
    T("Give me five tips to stay focused while {x}.", x=["working from home", "studying for exams",
      "reading a long book", "writing a report", "learning to code", "commuting by train"]),
]


# ---------------------------------------------------------------- code
PY_FUNCS = ["checks whether a string is a palindrome", "returns the n-th Fibonacci number",
            "removes duplicates from a list while keeping the original order",
            "counts how often each word appears in a text", "flattens a nested list",
            "checks whether a number is prime", "merges two sorted lists into one sorted list",
            "reverses the words in a sentence", "returns the second largest number in a list",
            "converts a Roman numeral to an integer", "groups a list of words by their first letter",
            "computes the factorial of n iteratively", "finds the longest common prefix of a list of strings",
            "chunks a list into pieces of size k", "validates a simple email address with a regex",
            "rotates a list by k positions", "checks whether two strings are anagrams",
            "computes the running average of a list of numbers", "transposes a matrix given as a list of lists",
            "returns all subsets of a small set", "converts a temperature from Celsius to Fahrenheit",
            "parses a query string like 'a=1&b=2' into a dict", "finds the most common element in a list",
            "computes the greatest common divisor of two integers", "capitalizes the first letter of every word"]
PY_EXTRAS = ["", " Include type hints.", " Add a short docstring.", " Include two example calls.",
             " Avoid using any imports.", " Make it handle empty input gracefully."]
PY_TASKS = ["read a CSV file and print the average of one column", "download a web page and count its links",
            "rename all .txt files in a folder to .md", "find the largest file in a directory tree",
            "read a JSON config file and fall back to defaults for missing keys",
            "time how long a function takes to run", "write a list of dicts to a CSV file",
            "parse command-line arguments with argparse", "run two tasks concurrently with asyncio",
            "log messages to both a file and the console", "memoize an expensive recursive function",
            "sort a list of dicts by two keys", "read a large text file line by line without loading it all"]
PY_CONCEPTS = ["list comprehensions", "generators and the yield keyword", "decorators",
               "context managers and the with statement", "*args and **kwargs", "dataclasses",
               "the difference between a list and a tuple", "the GIL", "virtual environments",
               "f-strings", "the __init__ method", "exceptions and try/except/finally",
               "lambda functions", "shallow versus deep copy", "type hints", "dictionary views"]
PY_FEATURES = ["list comprehensions", "generators", "decorators", "context managers", "dataclasses",
               "a tuple instead of a list", "a set instead of a list", "collections.defaultdict",
               "functools.lru_cache", "enumerate", "the walrus operator", "abstract base classes",
               "typing.NamedTuple", "pathlib instead of os.path"]
PY_SNIPPETS = [
    "nums = [3, 1, 2]\nprint(sorted(nums, reverse=True)[:2])",
    "d = {}\nfor w in 'a b a c b a'.split():\n    d[w] = d.get(w, 0) + 1\nprint(d)",
    "squares = {x: x * x for x in range(5) if x % 2}\nprint(squares)",
    "def f(x, acc=[]):\n    acc.append(x)\n    return acc\nprint(f(1), f(2))",
    "from functools import reduce\nprint(reduce(lambda a, b: a * b, range(1, 6)))",
    "s = 'hello world'\nprint(s[::-1].title())",
    "pairs = list(zip('abc', [1, 2, 3]))\nprint(dict(pairs))",
    "x = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    "print(any(n > 10 for n in [3, 8, 12]), all(n > 0 for n in [3, -1]))",
    "words = ['pear', 'fig', 'banana']\nprint(max(words, key=len))",
    "import itertools\nfor a, b in itertools.combinations([1, 2, 3], 2):\n    print(a + b)",
    "text = 'a,b,,c'\nprint([t for t in text.split(',') if t])",
]
PY_BUGS = [
    "def average(nums):\n    return sum(nums) / len(nums) + 1",
    "def is_even(n):\n    return n % 2 == 1",
    "def last(items):\n    return items[len(items)]",
    "for i in range(1, 10):\n    if i % 3 = 0:\n        print(i)",
    "def greet(name):\n    print('Hello, ' + name)\nmsg = greet('Ana')\nprint(msg.upper())",
    "total = 0\nfor n in ['1', '2', '3']:\n    total += n\nprint(total)",
    "def count_down(n):\n    while n > 0:\n        print(n)\n    print('done')",
    "def max_value(nums):\n    best = 0\n    for n in nums:\n        if n > best:\n            best = n\n    return best",
    "items = [1, 2, 3, 4]\nfor x in items:\n    if x % 2 == 0:\n        items.remove(x)\nprint(items)",
    "def add_item(item, basket=[]):\n    basket.append(item)\n    return basket",
    "with open('data.txt') as f:\n    lines = f.readlines\nprint(len(lines))",
]
SQL_TABLES = [("orders", "customer_id, amount, created_at"), ("employees", "name, department, salary, hired_on"),
              ("products", "name, category, price, stock"), ("students", "name, grade, class_id, score"),
              ("rentals", "movie_id, customer_id, rented_at, returned_at")]
SQL_ASKS = ["returns the top 5 rows by the numeric column", "counts rows per group",
            "finds duplicate values in the first column", "computes an average per group, only for groups with more than 3 rows",
            "returns rows from the last 30 days", "ranks rows within each group using a window function"]
SHELL_TASKS = ["count the lines in all .py files in a directory", "find files larger than 100 MB",
               "show the 10 most frequent IP addresses in an access log", "replace 'foo' with 'bar' in every .txt file",
               "list the 5 largest directories under the current folder", "delete .log files older than 7 days",
               "print the second column of a CSV file", "show which process is listening on port 8080",
               "compress a folder into a tar.gz archive", "watch a log file and print only lines containing ERROR",
               "count unique lines in a file", "rename all .jpeg files to .jpg"]
JS_TASKS = ["debounces a function", "deep clones a plain object", "fetches JSON from a URL with async/await",
            "capitalizes every word in a string", "removes duplicates from an array",
            "groups an array of objects by a property", "formats a number as currency",
            "checks whether an object is empty"]
JS_SNIPPETS = [
    "console.log([1, 2, 3].map(x => x * 2).filter(x => x > 2));",
    "const a = [1, 2];\nconst b = a;\nb.push(3);\nconsole.log(a);",
    "console.log(0.1 + 0.2 === 0.3);",
    "for (var i = 0; i < 3; i++) {\n  setTimeout(() => console.log(i), 0);\n}",
    "console.log(typeof null, typeof [], typeof undefined);",
]
ALGOS = ["binary search", "bubble sort", "breadth-first search on a graph", "quicksort",
         "a stack using a list", "an LRU cache", "Dijkstra's shortest path", "a queue using two stacks",
         "merge sort", "a trie for word lookups"]

CODE_MAKERS = [
    T("Write a Python function that {f}.{e}", f=PY_FUNCS, e=PY_EXTRAS),
    T("In Python, how would I write a function that {f}?", f=PY_FUNCS),
    T("Write a short Python script to {t}.", t=PY_TASKS),
    T("What's the most idiomatic way in Python to {t}?", t=PY_TASKS),
    T("Explain {c} in Python with a short example.", c=PY_CONCEPTS),
    T("When should I use {c} in Python? Give one practical example.", c=PY_FEATURES),
    T("Explain what this Python code does and what it prints:\n\n{s}", s=PY_SNIPPETS),
    T("What is the output of this snippet, and why?\n\n{s}", s=PY_SNIPPETS),
    T("This Python code has a bug. Can you find and fix it?\n\n{s}", s=PY_BUGS),
    T("Why doesn't this work as expected? Please explain and correct it.\n\n{s}", s=PY_BUGS),
    T("Given a table {t[0]}({t[1]}), write a SQL query that {a}.", t=SQL_TABLES, a=SQL_ASKS),
    T("I have a SQL table called {t[0]} with columns {t[1]}. How do I write a query that {a}?", t=SQL_TABLES, a=SQL_ASKS),
    T("Give me a shell one-liner to {t}.", t=SHELL_TASKS),
    T("What bash command would {t}? Explain each part briefly.", t=SHELL_TASKS),
    T("Write a JavaScript function that {t}.", t=JS_TASKS),
    T("What does this JavaScript print, and why?\n\n{s}", s=JS_SNIPPETS),
    T("Implement {a} in Python and state its time complexity.", a=ALGOS),
    T("Can you explain how {a} works and show a short Python implementation?", a=ALGOS),
    T("Write pytest unit tests for a Python function that {f}.", f=PY_FUNCS),
    T("How can I make this Python code more readable?\n\n{s}", s=PY_SNIPPETS),
    T("Rewrite this snippet without a loop, if possible:\n\n{s}", s=[
        "result = []\nfor x in range(10):\n    if x % 3 == 0:\n        result.append(x * x)",
        "total = 0\nfor p in prices:\n    total += p\nprint(total)",
        "names = []\nfor u in users:\n    names.append(u['name'].lower())",
        "found = False\nfor w in words:\n    if w.startswith('a'):\n        found = True",
        "counts = {}\nfor c in text:\n    counts[c] = counts.get(c, 0) + 1"]),
    T("What's the difference between {p} in Python?", p=["== and is", "append and extend",
      "sort() and sorted()", "a module and a package", "@staticmethod and @classmethod",
      "range and a list", "str() and repr()", "deepcopy and copy", "break and continue"]),
    T("How do I {t} in Python using only the standard library?", t=["read environment variables",
      "make an HTTP GET request", "generate a random password", "get today's date as YYYY-MM-DD",
      "walk a directory recursively", "compute the SHA-256 hash of a file", "zip two lists into a dict",
      "pretty-print a JSON file", "run a shell command and capture its output"]),
    T("Convert this Python function to JavaScript:\n\n{s}", s=[
        "def square_all(nums):\n    return [n * n for n in nums]",
        "def is_adult(age):\n    return age >= 18",
        "def join_names(names):\n    return ', '.join(sorted(names))",
        "def count_vowels(s):\n    return sum(1 for c in s.lower() if c in 'aeiou')"]),
    T("Write a Python class representing {o} with a couple of useful methods.", o=["a bank account",
      "a to-do list", "a shopping cart", "a 2D point", "a simple timer", "a deck of cards",
      "a temperature sensor reading", "a library book"]),
    T("Write a regular expression that matches {r}, and show how to use it in Python.", r=["US ZIP codes",
      "dates in YYYY-MM-DD format", "hex color codes like #1a2b3c", "simple email addresses",
      "IPv4 addresses", "words that start with a capital letter", "phone numbers like 555-123-4567"]),
]


# ---------------------------------------------------------------- math
NAMES = ["Maya", "Liam", "Priya", "Carlos", "Aisha", "Noah", "Yuki", "Elena", "Omar", "Sofia",
         "Ben", "Chloe", "Diego", "Hana", "Ivan", "Leila", "Marcus", "Nadia", "Tom", "Zara"]
MATH_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cupcakes", "stamps"]
SHOW = ["Show your work step by step.", "Please solve it step by step.", "Explain each step.",
        "Walk me through the solution step by step."]


def _m(fn):
    """Wrap a maker that returns the question so a step-by-step request is appended."""
    return lambda rng: fn(rng) + " " + rng.choice(SHOW)


def _linear(rng):
    a, x, b = rng.randint(2, 12), rng.randint(-9, 15), rng.randint(-30, 40)
    return "Solve for x: %dx %s %d = %d." % (a, "+" if b >= 0 else "-", abs(b), a * x + b)


def _system(rng):
    x, y = rng.randint(-5, 9), rng.randint(-5, 9)
    a, b, c, d = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 6), rng.randint(-6, -1)
    return "Solve the system of equations: %dx + %dy = %d and %dx %s %dy = %d." % (
        a, b, a * x + b * y, c, "-", -d, c * x + d * y)


def _quadratic(rng):
    r1, r2 = rng.randint(-9, 9), rng.randint(-9, 9)
    b, c = -(r1 + r2), r1 * r2
    return "Solve the quadratic equation x^2 %s %dx %s %d = 0." % (
        "+" if b >= 0 else "-", abs(b), "+" if c >= 0 else "-", abs(c))


def _shop(rng):
    n, items = rng.choice(NAMES), rng.choice(MATH_ITEMS)
    k, p, paid = rng.randint(3, 12), rng.randint(2, 9) * 25, rng.choice([20, 50, 100])
    return "%s buys %d %s at $%.2f each and pays with a $%d bill. How much change does %s get?" % (
        n, k, items, p / 100, paid, n)


def _share(rng):
    n, m, items = rng.choice(NAMES), rng.randint(3, 8), rng.choice(MATH_ITEMS)
    total = m * rng.randint(4, 15) + rng.randint(0, m - 1)
    return "%s has %d %s and wants to share them equally among %d friends. How many does each friend get, and how many are left over?" % (
        n, total, items, m)


def _speed(rng):
    n, v, t = rng.choice(NAMES), rng.randint(40, 110), rng.choice([1.5, 2, 2.5, 3, 3.5, 4, 4.5])
    return "%s drives at an average speed of %d km/h for %s hours. How far does %s travel?" % (
        n, v, ("%g" % t), n)


def _trains(rng):
    d, v1, v2 = rng.randint(12, 40) * 10, rng.randint(50, 90), rng.randint(50, 110)
    return "Two trains start %d km apart and travel toward each other at %d km/h and %d km/h. When do they meet?" % (
        d, v1, v2)


def _percent_off(rng):
    price, off = rng.randint(20, 300), rng.choice([10, 15, 20, 25, 30, 40, 50])
    item = rng.choice(["jacket", "lamp", "backpack", "pair of shoes", "board game", "monitor"])
    return "A %s costs $%d and is on sale for %d%% off. What is the sale price?" % (item, price, off)


def _percent_of(rng):
    return "What is %d%% of %d?" % (rng.choice([5, 12, 15, 18, 35, 45, 60, 75, 85]), rng.randint(40, 900))


def _interest(rng):
    p, r, y = rng.randint(5, 50) * 100, rng.choice([2, 3, 4, 5, 6, 7]), rng.randint(2, 6)
    kind = rng.choice(["simple", "compound (annually)"])
    return "If you invest $%d at %d%% %s interest for %d years, how much will you have at the end?" % (p, r, kind, y)


def _rect(rng):
    w, h = rng.randint(3, 25), rng.randint(3, 25)
    thing = rng.choice(["garden", "room", "rug", "parking lot", "poster"])
    return "A rectangular %s is %d m long and %d m wide. What are its area and perimeter?" % (thing, w, h)


def _circle(rng):
    r = rng.randint(2, 30)
    return "A circle has a %s of %d cm. Find its circumference and area (use pi ≈ 3.14)." % (
        rng.choice(["radius", "diameter"]), r)


def _triangle(rng):
    a, b = rng.choice([(3, 4), (5, 12), (6, 8), (8, 15), (9, 12), (7, 24), (12, 16), (20, 21)])
    return "A right triangle has legs of length %d and %d. How long is the hypotenuse?" % (a, b)


def _arith(rng):
    a, b, c, d = rng.randint(12, 99), rng.randint(2, 19), rng.randint(10, 80), rng.randint(2, 9)
    return "Compute %d × %d − %d ÷ %d without a calculator." % (a, b, c * d, d)


def _fractions(rng):
    b, d = rng.randint(2, 9), rng.randint(2, 9)
    a, c = rng.randint(1, b - 1), rng.randint(1, d - 1)
    op = rng.choice(["+", "−", "×", "÷"])
    return "Calculate %d/%d %s %d/%d and simplify the result." % (a, b, op, c, d)


def _ages(rng):
    n1, n2 = rng.sample(NAMES, 2)
    k, y, s = rng.randint(2, 4), rng.randint(4, 14), rng.randint(2, 10)
    return "%s is %d times as old as %s. In %d years, the sum of their ages will be %d. How old are they now?" % (
        n1, k, n2, s, (k + 1) * y + 2 * s)


def _work(rng):
    a, b = rng.sample([2, 3, 4, 5, 6, 8, 10, 12], 2)
    n1, n2 = rng.sample(NAMES, 2)
    return "%s can paint a fence in %d hours and %s can paint it in %d hours. How long will it take if they work together?" % (
        n1, a, n2, b)


def _mixture(rng):
    v, c1, c2 = rng.randint(2, 10), rng.choice([10, 20, 30]), rng.choice([50, 60, 70, 90])
    return "How many liters of a %d%% salt solution must be added to %d liters of a %d%% solution to get a %d%% solution?" % (
        c2, v, c1, (c1 + c2) // 2)


def _average(rng):
    while True:
        scores = [rng.randint(55, 100) for _ in range(rng.randint(3, 5))]
        target = rng.choice([75, 80, 85, 90])
        needed = target * (len(scores) + 1) - sum(scores)
        if 0 < needed <= 100:
            break
    return "%s scored %s on the first tests. What score is needed on the next test to average %d?" % (
        rng.choice(NAMES), ", ".join(map(str, scores)), target)


def _probability(rng):
    r, b, g = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 6)
    return "A bag has %d red, %d blue and %d green marbles. If you draw two without replacement, what is the probability both are red?" % (
        r, b, g)


def _dice(rng):
    return "When rolling two fair dice, what is the probability that the sum is %d?" % rng.randint(2, 12)


def _sequence(rng):
    a, d, n = rng.randint(1, 20), rng.randint(2, 9), rng.randint(10, 60)
    suf = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return "What is the %d%s term of the arithmetic sequence %d, %d, %d, ...? Also find the sum of the first %d terms." % (
        n, suf, a, a + d, a + 2 * d, n)


def _unit(rng):
    n, cost = rng.randint(2, 8), rng.randint(2, 9)
    m = rng.choice([k for k in range(3, 15) if k != n])
    item = rng.choice(["notebooks", "pens", "mugs", "candles", "tickets"])
    return "%d %s cost $%d. At the same price, how much would %d %s cost?" % (n, item, cost * n, m, item)


def _ratio(rng):
    a, b = rng.choice([(1, 2), (2, 3), (3, 4), (3, 5), (4, 5), (5, 7), (2, 5), (5, 4), (3, 2), (7, 5)])
    t = rng.randint(3, 8)
    return "In a class, the ratio of girls to boys is %d:%d. If there are %d students in total, how many are girls?" % (
        a, b, (a + b) * t)


def _derivative(rng):
    a, n, b, c = rng.randint(2, 9), rng.randint(2, 5), rng.randint(1, 12), rng.randint(1, 20)
    return "Find the derivative of f(x) = %dx^%d + %dx - %d and evaluate it at x = %d." % (a, n, b, c, rng.randint(1, 4))


def _exponent(rng):
    b, e = rng.choice([2, 3, 5]), rng.randint(3, 7)
    return "Solve for x: %d^(x + %d) = %d." % (b, rng.randint(1, 3), b ** e)


def _temp(rng):
    return "Convert %d°F to Celsius and explain the formula." % rng.randint(-10, 110)


def _wage(rng):
    n, w, h, o = rng.choice(NAMES), rng.randint(14, 32), rng.randint(36, 50), rng.choice([1.5, 2])
    return "%s earns $%d per hour, with overtime paid at %g times the rate after 40 hours. How much does %s earn for a %d-hour week?" % (
        n, w, o, n, h)


MATH_MAKERS = [_m(f) for f in [
    _linear, _system, _quadratic, _shop, _share, _speed, _trains, _percent_off, _percent_of,
    _interest, _rect, _circle, _triangle, _arith, _fractions, _ages, _work, _mixture, _average,
    _probability, _dice, _sequence, _unit, _ratio, _derivative, _exponent, _temp, _wage]]


# ---------------------------------------------------------------- chat_fr
FR_SUJETS = ["la photosynthèse", "l'inflation", "les trous noirs", "le cycle de l'eau", "les intérêts composés",
             "le système immunitaire", "le réchauffement climatique", "la Bourse", "la tectonique des plaques",
             "l'intelligence artificielle", "les marées", "l'effet placebo", "la loi de l'offre et de la demande",
             "les arcs-en-ciel", "la Révolution française", "l'ADN", "la gravité", "les énergies renouvelables",
             "le décalage horaire", "la TVA", "le sommeil paradoxal", "les vaccins"]
FR_PUBLICS = ["un enfant de 10 ans", "ma grand-mère", "un lycéen", "quelqu'un qui n'a jamais fait de sciences",
              "un nouveau collègue"]
FR_TACHES = ["faire une pâte à crêpes", "changer une roue de vélo", "déboucher un évier", "réussir une mayonnaise",
             "détartrer une bouilloire", "rempoter une plante", "faire une pâte brisée maison",
             "préparer un entretien d'embauche", "rédiger une lettre de motivation", "enlever une tache de vin rouge",
             "sauvegarder les photos de mon téléphone", "commencer à courir quand on est débutant",
             "faire un budget mensuel", "ranger un petit appartement", "apprendre à méditer",
             "entretenir une poêle en fonte", "cuire du riz sans qu'il colle", "faire un bon café filtre"]
FR_PROBLEMES = ["j'ai du mal à m'endormir le soir", "je remets toujours tout au lendemain",
                "je stresse avant de parler en public", "mon voisin fait du bruit tard le soir",
                "je dépense trop en livraisons de repas", "je n'arrive pas à me concentrer quand je télétravaille",
                "je viens de déménager et je ne connais personne", "mes plantes d'intérieur dépérissent",
                "je suis fatigué tous les après-midi", "j'ai du mal à dire non à mes amis",
                "je voudrais lire davantage mais je n'ai jamais le temps", "je me sens débordé au travail"]
FR_ECRITS = ["un petit mot de remerciement pour ma voisine qui a arrosé mes plantes",
             "un e-mail poli à mon propriétaire pour signaler une fuite d'eau",
             "un message d'anniversaire pour une collègue", "un SMS pour m'excuser d'avoir annulé un dîner",
             "un haïku sur l'automne", "un court poème sur la mer", "une réponse automatique d'absence pour une semaine de congés",
             "une courte description pour un pot de miel artisanal", "un petit discours pour le mariage de mon frère",
             "un e-mail de relance pour une facture impayée", "un message pour décliner poliment une invitation",
             "une annonce pour vendre mon vélo d'occasion", "un mot d'accueil pour un nouveau collègue",
             "un avis de deux phrases sur un petit restaurant de quartier"]
FR_CHOIX = [("le thé", "le café"), ("louer", "acheter un logement"), ("le télétravail", "le bureau"),
            ("un ordinateur portable", "un ordinateur fixe"), ("le train", "la voiture"),
            ("une plaque à induction", "une gazinière"), ("les livres papier", "les livres audio"),
            ("courir dehors", "courir sur un tapis"), ("une carte de crédit", "une carte de débit"),
            ("un livret A", "une assurance-vie"), ("un vélo électrique", "un vélo classique"),
            ("les cours en ligne", "les cours en présentiel")]
# (name to visit, "for N days in/at" form)
FR_VILLES = [("Lyon", "à Lyon"), ("Marseille", "à Marseille"), ("Bordeaux", "à Bordeaux"),
             ("la Bretagne", "en Bretagne"), ("Lisbonne", "à Lisbonne"), ("Rome", "à Rome"),
             ("Montréal", "à Montréal"), ("Bruxelles", "à Bruxelles"), ("la Provence", "en Provence"),
             ("Barcelone", "à Barcelone"), ("Strasbourg", "à Strasbourg"), ("l'Alsace", "en Alsace"),
             ("Nice", "à Nice"), ("la Corse", "en Corse")]
FR_JOURS = ["deux", "trois", "quatre", "cinq", "sept"]
FR_ALIMENTS = ["des lentilles", "du poulet", "du tofu", "des courgettes", "des œufs", "du saumon",
               "des pois chiches", "des champignons", "des épinards", "des pommes de terre", "du riz", "des tomates"]
FR_LOISIRS = ["la peinture", "les échecs", "l'escalade", "le tricot", "la photographie", "la guitare",
              "la poterie", "l'espagnol", "le yoga", "la pâtisserie", "le jardinage"]
FR_ACHATS = ["un manteau d'hiver", "des chaussures de course", "une voiture d'occasion", "un matelas",
             "un ordinateur pour mes études", "une machine à café", "un casque à réduction de bruit", "une tente"]
FR_MOTS = [("« davantage »", "« d'avantage »"), ("« quand »", "« quant »"), ("« près »", "« prêt »"),
           ("« a »", "« à »"), ("« ou »", "« où »"), ("« censé »", "« sensé »"), ("« la plupart »", "« la majorité »"),
           ("« tâche »", "« tache »"), ("« ça »", "« sa »")]
FR_PERSONNES = ["mon père", "ma mère", "un collègue", "ma meilleure amie", "un adolescent", "mon patron",
                "une amie qui adore la randonnée", "un passionné de cuisine"]
FR_BUDGETS = ["20 €", "30 €", "50 €", "100 €"]
FR_POURQUOI = ["le ciel est bleu", "les oignons font pleurer", "les chats ronronnent", "la glace flotte sur l'eau",
               "on bâille", "les feuilles changent de couleur en automne", "le pain lève",
               "les avions tiennent en l'air", "la Lune a des phases", "on a des années bissextiles"]

FR_MAKERS = [
    T("Peux-tu m'expliquer {s} simplement ?", s=FR_SUJETS),
    T("Comment expliquerais-tu {s} à {p} ?", s=FR_SUJETS, p=FR_PUBLICS),
    T("Quelles sont les idées reçues les plus courantes sur {s} ?", s=FR_SUJETS),
    T("Résume-moi {s} en trois phrases.", s=FR_SUJETS),
    T("Comment {t} ? Donne-moi les étapes.", t=FR_TACHES),
    T("Quelle est la méthode la plus simple pour {t} ?", t=FR_TACHES),
    T("Quelles erreurs éviter quand on veut {t} ?", t=FR_TACHES),
    T("Bonjour, {p}. Tu aurais des conseils ?", p=FR_PROBLEMES),
    T("J'ai un souci : {p}. Que me conseilles-tu ?", p=FR_PROBLEMES),
    T("Peux-tu m'écrire {e} ?", e=FR_ECRITS),
    T("Aide-moi à rédiger {e}, quelque chose de court et naturel.", e=FR_ECRITS),
    T("Entre {c[0]} et {c[1]}, quels sont les avantages et les inconvénients de chaque option ?", c=FR_CHOIX),
    T("J'hésite entre {c[0]} et {c[1]}. Qu'est-ce que je devrais prendre en compte ?", c=FR_CHOIX),
    T("Tu peux me proposer un programme de {j} jours pour visiter {v[0]} ?", j=FR_JOURS, v=FR_VILLES),
    T("Que faut-il mettre dans sa valise pour {j} jours {v[1]} ?", j=FR_JOURS, v=FR_VILLES),
    T("Qu'est-ce que je peux cuisiner ce soir avec {a[0]} et {a[1]} ?", a=lambda rng: rng.sample(FR_ALIMENTS, 2)),
    T("Donne-moi une idée de déjeuner équilibré avec {a}.", a=FR_ALIMENTS),
    T("Quelle est la différence entre {m[0]} et {m[1]} ?", m=FR_MOTS),
    T("Comment débuter {l} à l'âge adulte ?", l=FR_LOISIRS),
    T("J'ai {n} minutes par jour. Comment progresser {l} ?", n=["10", "15", "20", "30"],
      l=["en peinture", "aux échecs", "en escalade", "en tricot", "en photographie", "à la guitare", "en espagnol",
         "en yoga", "en pâtisserie"]),
    T("Qu'est-ce qu'il faut regarder avant d'acheter {a} ?", a=FR_ACHATS),
    T("Tu peux m'expliquer brièvement pourquoi {p} ?", p=FR_POURQUOI),
    T("Tu as une idée de cadeau à moins de {b} pour {p} ?", b=FR_BUDGETS, p=FR_PERSONNES),
    T("Comment engager la conversation avec {p} ?", p=["un voisin que je connais à peine", "une nouvelle collègue",
      "les autres parents à la sortie de l'école", "des inconnus lors d'un mariage", "un nouveau stagiaire"]),
    T("Donne-moi cinq astuces pour rester concentré quand {x}.", x=["je travaille de chez moi",
      "je révise mes examens", "je lis un long livre", "j'écris un rapport", "j'apprends à coder"]),
    T("Raconte-moi en quelques phrases l'histoire {h}.", h=["de l'imprimerie", "du vélo", "du café",
      "des Jeux olympiques", "du téléphone", "de la baguette", "du jazz", "de la tour Eiffel", "du croissant"]),
]


# ---------------------------------------------------------------- code edits
# Requests whose answer repeats most of the prompt: edit a short function and show all of it again,
# or restate given records in another format. Text repeats here; a suffix index should see it.
EDIT_NAMES = ["total", "count", "items", "result", "values", "scores", "names", "prices", "rows", "data",
              "words", "numbers", "users", "orders", "lines", "parts", "keys", "sizes"]
EDIT_FUNCS = ["process", "compute", "summarize", "clean", "collect", "merge", "parse", "update", "build",
              "filter_rows", "normalize", "group", "count_words", "average", "find_max", "flatten"]


def edit_code(rng):
    a, b, c = rng.sample(EDIT_NAMES, 3)
    f = rng.choice(EDIT_FUNCS)
    n = rng.randint(2, 9)
    bodies = [
        "def {f}({a}):\n    {b} = []\n    for x in {a}:\n        if x > {n}:\n            {b}.append(x * 2)\n"
        "    return {b}",
        "def {f}({a}, {c}):\n    {b} = 0\n    for x in {a}:\n        {b} += x * {c}\n    return {b} / len({a})",
        "def {f}({a}):\n    {b} = {{}}\n    for key, value in {a}.items():\n        {b}[key] = value + {n}\n"
        "    return {b}",
        "def {f}({a}):\n    {b} = sorted({a})\n    {c} = {b}[:{n}]\n    return sum({c}) / len({c})",
        "def {f}({a}):\n    {b} = {a}.strip().split()\n    {c} = [w.lower() for w in {b} if len(w) > {n}]\n"
        "    return {c}",
        "def {f}({a}, {c}={n}):\n    {b} = []\n    for i in range(0, len({a}), {c}):\n"
        "        {b}.append({a}[i : i + {c}])\n    return {b}",
    ]
    return rng.choice(bodies).format(f=f, a=a, b=b, c=c, n=n), (a, b, c, f)


def edit_prompt(rng):
    code, (a, b, c, f) = edit_code(rng)
    new = rng.choice([x for x in EDIT_NAMES if x not in (a, b, c)])
    asks = [
        "Rename the variable `{b}` to `{new}` in this function and show the whole function again:",
        "Add type hints to this function. Reply with the complete function:",
        "Add a short docstring to this function and show all of it:",
        "Rename the function `{f}` to `{f}_v2` and show the complete code:",
        "Add a comment above each line of this function. Reply with the full function:",
        "Rewrite this function with `{a}` renamed to `{new}`; keep everything else the same:",
    ]
    ask = rng.choice(asks).format(a=a, b=b, f=f, new=new)
    return "%s\n\n```python\n%s\n```" % (ask, code)


def records_prompt(rng):
    people = rng.sample(["Alice", "Bob", "Chloe", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jack",
                         "Kenji", "Lena", "Marco", "Nadia", "Omar", "Paula"], rng.randint(3, 5))
    rows = ["%s,%d,%s" % (p, rng.randint(18, 70), rng.choice(["Paris", "Lyon", "Berlin", "Madrid", "Rome",
                                                              "Oslo", "Porto", "Vienna"])) for p in people]
    fmt = rng.choice(["a JSON array of objects with keys name, age and city",
                      "a Markdown table with columns Name, Age and City",
                      "a Python list of dictionaries with keys name, age and city"])
    return "Convert these CSV rows (name,age,city) into %s:\n\n%s" % (fmt, "\n".join(rows))


EDIT_MAKERS = [edit_prompt, edit_prompt, records_prompt]


# ---------------------------------------------------------------- main
WORKLOADS = [
    ("chat_en.jsonl", EN_MAKERS),
    ("code.jsonl", CODE_MAKERS),
    ("math.jsonl", MATH_MAKERS),
    ("chat_fr.jsonl", FR_MAKERS),
    ("code_edits.jsonl", EDIT_MAKERS),  # last: the four above stay byte-identical
]


def main():
    rng = random.Random(SEED)
    for name, makers in WORKLOADS:
        prompts = build(rng, makers)
        path = write_jsonl(name, prompts)
        print("wrote %d lines to %s" % (len(prompts), os.path.relpath(path)))


if __name__ == "__main__":
    main()
