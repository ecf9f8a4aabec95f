"""Prompts the target answers itself for self-distillation (none taken from a benchmark).

Five families in fixed shares, each generated from templates and word lists with a seeded RNG:
explanations, writing and role-play requests, code (stubs built from the Python standard
library's own documented functions, and one-line "write a function" requests), grade-school
word problems and competition-style algebra. Breadth matters more than volume: a draft only
learns to predict the kinds of answers it has seen.
"""

from __future__ import annotations

import ast
import random
import sysconfig
from functools import lru_cache
from pathlib import Path

SUBJECTS = [
    "photosynthesis", "the water cycle", "black holes", "compound interest", "machine learning",
    "the French Revolution", "climate change", "vaccines", "the stock market", "recursion",
    "prime numbers", "the immune system", "volcanoes", "electric cars", "the internet",
    "democracy", "gravity", "DNA", "the Roman Empire", "renewable energy", "sleep",
    "coffee", "honeybees", "the moon landing", "inflation", "blockchain", "earthquakes",
    "the human heart", "plate tectonics", "quantum computing", "the Renaissance",
    "ocean tides", "solar panels", "meditation", "the printing press", "antibiotics",
    "rainbows", "the speed of light", "hash tables", "sorting algorithms", "neural networks",
    "the Great Wall of China", "chess", "jazz music", "healthy eating", "time management",
    "public speaking", "gardening", "the Pythagorean theorem", "probability", "fractions",
    "supply and demand", "the periodic table", "evolution", "cloud computing", "encryption",
    "dinosaurs", "the Olympic Games", "marathon training", "bread baking", "recycling",
    "the solar system", "photosynthesis in algae", "the Industrial Revolution", "batteries",
    "the human brain", "artificial intelligence", "the Amazon rainforest", "glaciers",
    "social media", "remote work", "budgeting", "credit scores", "nutrition labels",
    "the Cold War", "ancient Egypt", "the Silk Road", "Shakespeare", "impressionism",
    "photography", "video games", "electric guitars", "classical music", "film editing",
    "the stock exchange", "taxes", "small businesses", "negotiation", "leadership",
    "team work", "learning a language", "the scientific method", "statistics", "calculus",
    "linear algebra", "matrices", "logarithms", "geometry", "graph theory", "databases",
    "operating systems", "compilers", "version control", "unit testing", "APIs",
    "web browsers", "password security", "open source software", "3D printing", "robots",
    "self-driving cars", "airplanes", "rockets", "submarines", "bridges", "skyscrapers",
    "wind turbines", "nuclear power", "air pollution", "biodiversity", "coral reefs",
    "migration of birds", "cats", "dogs", "wolves", "elephants", "octopuses", "mushrooms",
    "tea", "chocolate", "pizza", "spices", "fermentation", "running shoes", "yoga",
    "the Moon", "Mars", "comets", "the Big Bang", "magnetism", "electricity", "sound waves",
]
TEMPLATES = [
    "What is {s}?", "Explain {s} in simple terms.", "Give me three interesting facts about {s}.",
    "Why is {s} important?", "Write a short paragraph about {s}.",
    "How would you explain {s} to a child?", "What are the main ideas behind {s}?",
    "Summarize the history of {s} in a few sentences.", "What are common misconceptions about {s}?",
    "Write a haiku about {s}.", "List the pros and cons of {s}.", "Tell me a fun story involving {s}.",
    "What should a beginner know about {s}?", "Compare {s} and {t}.",
    "Write a short email to a friend recommending they learn about {s}.",
    "Write a blog post introduction about {s}.", "Describe {s} in two sentences.",
    "What is the connection between {s} and {t}?", "Write a limerick about {s}.",
    "Pretend you are a teacher. Give a short lesson on {s}.",
    "What are the biggest open questions about {s}?", "How has {s} changed over time?",
    "Give a step-by-step guide to getting started with {s}.",
    "Write a persuasive paragraph arguing that everyone should care about {s}.",
    "Create a short quiz with three questions about {s}.",
    "Write a dialogue between two friends discussing {s}.",
    "What would happen if {s} did not exist?", "Define {s} and give an example.",
    "Write a product description for a book about {s}.",
    "Explain how {s} affects everyday life.",
]
CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the factorial of n",
    "computes the n-th Fibonacci number", "counts the vowels in a string",
    "removes duplicates from a list while keeping order", "finds the largest element of a list",
    "checks whether a string is a palindrome", "merges two sorted lists",
    "returns the sum of the digits of an integer", "flattens a nested list",
    "counts word frequencies in a text", "converts Celsius to Fahrenheit",
    "computes the greatest common divisor of two numbers", "sorts a list of tuples by the second item",
    "returns the second largest number in a list", "checks whether two strings are anagrams",
    "implements binary search", "transposes a matrix", "validates an email address with a regex",
    "returns the n-th triangular number", "counts the occurrences of a character in a string",
    "returns the common elements of two lists", "checks whether a year is a leap year",
    "converts a decimal number to binary", "finds the minimum of three numbers",
    "capitalizes the first letter of every word", "returns the length of the longest word",
    "rotates a list by k positions", "checks whether a list is sorted",
    "computes the average of a list of numbers", "returns all even numbers from a list",
    "replaces spaces in a string with underscores", "computes the power set of a set",
    "finds the index of the first repeated character", "computes the area of a circle",
    "splits a list into chunks of size n", "returns the median of a list",
    "checks whether a number is a perfect square", "counts the lines in a text file",
    "sums the squares of the first n natural numbers", "removes all vowels from a string",
    "returns the product of all elements in a list", "finds the missing number in 1..n",
    "converts a list of strings to integers", "checks whether parentheses are balanced",
]
CODE_TEMPLATES = [
    "Write a Python function that {c}.", "Write a Python function that {c}. Include a docstring.",
    "How do I write a function in Python that {c}?", "Write a JavaScript function that {c}.",
    "Explain step by step how to write code that {c}.",
    "Write a function that {c}.", "Write a Python program that {c} and prints the result.",
    "Write a Python function that {c}, with two test cases.", "Write a C function that {c}.",
    'Complete this Python function:\n\ndef solve(data):\n    """A function that {c}."""\n',
]
MATH_TEMPLATES = [
    "A shop sells apples for ${a} each. Tom buys {b} apples and pays with a ${c} bill. "
    "How much change does he get?",
    "A train travels {a} miles per hour for {b} hours. How far does it go?",
    "Sara has {a} marbles. She gives {b} to her brother and buys {c} more. How many does she have?",
    "What is {a} times {b}, plus {c}?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "If {a} workers build a wall in {b} days, how long would {c} workers take?",
    "Solve for x: {a}x + {b} = {c}.", "What is the sum of the first {a} positive integers?",
    "A recipe needs {b} eggs for {a} cookies. How many eggs are needed for {c} cookies?",
    "Lisa reads {a} pages a day. How many days does she need for a {c}{b}-page book?",
    "A car uses {b} liters of fuel per 100 km. How much fuel does it need for {a}0 km?",
    "What is {a}% of {c}0?", "Find the remainder when {c}{a} is divided by {b}.",
    "A class has {a} students and {b} of them are absent. What fraction is present?",
    "John earns ${a} per hour and works {b} hours a week. How much does he earn in {c} weeks?",
    "What is the least common multiple of {a} and {b}?",
]

NAMES = ["Maria", "James", "Aisha", "Kenji", "Olivia", "Liam", "Priya", "Mateo", "Chloe", "Noah",
         "Fatima", "Lucas", "Mei", "Ethan", "Sofia", "Omar", "Grace", "Ivan", "Zara", "Daniel"]
GOODS = [("cupcakes", 3), ("notebooks", 4), ("tickets", 12), ("plants", 7), ("bracelets", 5),
         ("jars of honey", 9), ("candles", 6), ("toy cars", 8), ("pies", 15), ("mugs", 11)]
WORD_PROBLEMS = [
    "{n} sells {g} at a market. On Monday {n} sells {a}, on Tuesday twice as many, and on "
    "Wednesday {b} fewer than on Tuesday. Each costs ${p}. How much money does {n} make?",
    "{n} is saving for a ${c}0 bike, already has ${b} and earns ${a} a week. How many weeks "
    "until {n} can buy the bike?",
    "A bakery makes {a} trays of {g} with {b} on each tray. It sells half of them in the morning "
    "and {c} in the afternoon. How many are left?",
    "{n} is {a} years old. {m} is {b} years older than {n}, and their aunt is three times as old "
    "as {m}. How old is the aunt?",
    "{n} buys {a} {g} at ${p} each and {b} more at ${q} each. {n} pays with ${c}00. How much "
    "change does {n} get?",
    "A farmer has {c} chickens and {a} cows. How many legs do the animals have in total?",
    "{n} runs {a} km every weekday and twice that on Saturday. How far does {n} run in {b} weeks?",
    "A tank holds {c}0 liters. It is filled at {a} liters per minute while it leaks {b} liters "
    "per minute. How long does it take to fill from empty?",
    "{n} reads {a} pages on Monday, {b} more on Tuesday than on Monday, and half as many on "
    "Wednesday as on Tuesday. How many pages did {n} read?",
    "There are {c} students in a school. {a}% of them walk to school and {b} ride the bus; the rest "
    "are driven. How many are driven?",
    "{n} and {m} share {c}0 stickers in the ratio {a}:{b}. How many stickers does {m} get?",
    "A phone costs ${c}0. It is on sale for {a}% off, and then a ${b} coupon is applied. What is "
    "the final price?",
    "{n} works {a} hours a week at ${p} an hour and gets time and a half for every hour over "
    "{b}. How much does {n} earn in a week?",
    "A box of {g} holds {a}. {n} needs {c}0 of them for a party. How many boxes must {n} buy?",
    "{n} plants {a} rows of {b} tomato plants. Each plant gives {p} tomatoes. {n} gives away "
    "{c} tomatoes. How many are left?",
]
ALGEBRA = [
    "What is the value of ${a}^2 - {b}^2$?", "Find the greatest common divisor of ${c}{a}$ and ${b}{c}$.",
    "Solve for $x$: $\\frac{{x}}{{{a}}} + {b} = {c}$.", "How many positive divisors does ${c}{b}$ have?",
    "Compute $\\dbinom{{{a}}}{{{p}}}$.", "If $f(x) = {p}x^2 + {b}x - {c}$, what is $f({q})$?",
    "What is the remainder when ${a}^{{{p}}}$ is divided by ${q}$?", "Simplify $\\sqrt{{{c}{b}}}$.",
    "The sum of two numbers is ${c}$ and their difference is ${b}$. What is the larger number?",
    "Find the distance between the points $({a}, {b})$ and $({p}, {q})$.",
    "What is the slope of the line through $({a}, {b})$ and $({q}, {c})$?",
    "A right triangle has legs of length ${a}$ and ${b}$. What is the length of its hypotenuse? "
    "Express your answer in simplest radical form.",
    "Evaluate $\\left\\lceil \\frac{{{c}}}{{{p}}} \\right\\rceil$.",
    "What is the sum of all integers $x$ such that $|x - {a}| < {p}$?",
    "In how many ways can {p} people be seated in a row of {q} chairs?",
    "Find the area of a circle with circumference ${a}\\pi$. Express your answer in terms of $\\pi$.",
    "What is the sum of the first ${a}$ terms of the arithmetic sequence ${p}, {q}, \\ldots$?",
    "Find all real $x$ such that $x^2 - {a}x + {b} = 0$.",
    "If $\\log_{{{p}}} x = {q}$, what is $x$?", "What is ${a}\\%$ of ${c}0$?",
    "Let $g(x) = {p}x + {b}$. Find $g^{{-1}}({c})$.",
    "The angles of a triangle are in the ratio ${p}:{q}:{a}$. What is the largest angle, in degrees?",
    "How many integers between ${b}$ and ${c}{a}$ are multiples of ${p}$?",
    "Convert ${c}{a}_{{10}}$ to base ${p}$.",
]
STEP = "\nPlease reason step by step, and put your final answer within \\boxed{}."
FORMS = ["a blog post", "a persuasive essay", "a short story", "a poem", "a speech", "an email",
         "a product review", "a cover letter", "a news article", "a podcast script",
         "a travel guide", "a restaurant review", "a letter to a friend", "a social media post",
         "a movie plot summary", "a motivational talk", "a job advertisement", "a diary entry",
         "a press release", "a set of interview questions"]
OCCASIONS = ["a recent trip to {place}", "the opening of a new library in {place}",
             "a weekend hiking near {place}", "a food festival in {place}", "{s}",
             "why {s} matters", "a surprising discovery about {s}", "a local charity run",
             "the first day at a new job", "a team's quarterly results", "a lost dog found in {place}",
             "learning to cook", "a failed experiment and what it taught you"]
PLACES = ["Hawaii", "Kyoto", "Lisbon", "Cairo", "Patagonia", "Iceland", "Marrakesh", "Vancouver",
          "Rome", "Istanbul", "the Alps", "Seoul", "Nairobi", "Mexico City", "Edinburgh", "Bali"]
STYLES = ["", " Keep it under 150 words.", " Use a humorous tone.", " Use three bullet points.",
          " Write it for high school students.", " Make it suspenseful.", " Keep it formal.",
          " End with a question for the reader.", " Use vivid sensory details."]
PERSONAS = ["a pirate captain", "Sherlock Holmes", "a medieval knight", "a startup founder",
            "a tour guide in {place}", "a nutritionist", "an astronaut", "a history teacher",
            "a grumpy chef", "a park ranger", "a detective", "a fitness coach", "a librarian",
            "a time traveller from the year 3000", "a customer support agent", "a poet"]
ROLE_ASKS = ["Describe your typical day.", "What advice would you give a beginner?",
             "Explain {s} from your point of view.", "How do you handle a difficult problem?",
             "Tell me about your greatest challenge.", "What do you think of {s}?",
             "Introduce yourself to a new colleague."]
REASONING = [
    "{n} is taller than {m}, and {m} is taller than {o}. Who is the shortest? Explain.",
    "If it takes {a} machines {a} minutes to make {a} widgets, how long would {c} machines take "
    "to make {c} widgets?",
    "{n} has {a} sisters, and each sister has one brother. How many children are in the family?",
    "A bat and a ball cost ${p}.{b} in total, and the bat costs ${p} more than the ball. "
    "How much does the ball cost?",
    "Which is heavier, a kilogram of {g} or a kilogram of feathers? Explain.",
    "Extract the names and places from this sentence and return them as JSON: \"{n} met {m} in "
    "{place} before flying with {o} to {place2}.\"",
    "Sort these words alphabetically and explain your steps: {w}.",
    "Rewrite this sentence in the passive voice: \"{n} painted the fence while {m} watched.\"",
]
FOLLOW_UPS = ["", " Then give one example.", " Answer in one paragraph.",
              " Then summarise your answer in one sentence."]


@lru_cache(maxsize=1)
def stdlib_functions() -> tuple[tuple[str, str, str], ...]:
    """(name, signature, docstring) of documented public functions in the standard library.

    Real, varied code requests without touching any benchmark; the set depends only on the
    Python version.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for f in sorted(root.glob("*.py")) + sorted(root.glob("[a-z]*/*.py")):
        if any(part in ("test", "tests", "idlelib", "lib2to3", "turtledemo",
                                        "site-packages", "dist-packages") for part in f.parts):
            continue
        try:
            tree = ast.parse(f.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node) or ""
            if 40 <= len(doc) <= 600 and node.args.args:
                ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
                found.append((node.name, f"def {node.name}({ast.unparse(node.args)}){ret}:", doc))
    return tuple(found)


def _stub(rng: random.Random) -> str:
    name, sig, doc = rng.choice(stdlib_functions())
    body = "\n    ".join(doc.splitlines())
    code = f'{sig}\n    """{body}\n    """\n'
    first = doc.split(".")[0].strip().replace("\n", " ")
    return rng.choice([
        f"Write a solution to the following problem:\n```python\n{code}\n```",
        f"Complete the following Python function.\n```python\n{code}```",
        f"Implement this function in Python:\n\n{code}",
        f"Write a python function `{name}` to {first[0].lower()}{first[1:]}.",
        f"Write a function to {first[0].lower()}{first[1:]}.",
    ])


def _numbers(rng: random.Random) -> dict:
    n, m, o = rng.sample(NAMES, 3)
    g, p = rng.choice(GOODS)
    place, place2 = rng.sample(PLACES, 2)
    words = ", ".join(rng.sample(SUBJECTS, 4))
    return dict(n=n, m=m, o=o, g=g, p=p, place=place, place2=place2, w=words, s=rng.choice(SUBJECTS),
                a=rng.randint(2, 40), b=rng.randint(2, 25), c=rng.randint(3, 90), q=rng.randint(2, 9))


def _request(rng: random.Random, kind: float) -> str:
    v = _numbers(rng)
    if kind < 0.13:  # explanations
        s, t = rng.sample(SUBJECTS, 2)
        return rng.choice(TEMPLATES).format(s=s, t=t) + rng.choice(FOLLOW_UPS)
    if kind < 0.30:  # writing
        what = rng.choice(OCCASIONS).format(**v)
        verb = rng.choice(["Write", "Compose", "Draft", "Create"])
        return f"{verb} {rng.choice(FORMS)} about {what}.{rng.choice(STYLES)}"
    if kind < 0.37:  # role-play
        who = rng.choice(PERSONAS).format(**v)
        return f"Pretend you are {who}. {rng.choice(ROLE_ASKS).format(**v)}"
    if kind < 0.44:
        return rng.choice(REASONING).format(**v)
    if kind < 0.64:
        return _stub(rng)
    if kind < 0.70:
        return rng.choice(CODE_TEMPLATES).format(c=rng.choice(CODE_TASKS))
    if kind < 0.85:
        return rng.choice(WORD_PROBLEMS + MATH_TEMPLATES).format(**v) + STEP
    return rng.choice(ALGEBRA).format(**v) + STEP


def chat_prompts(n: int, seed: int = 0) -> list[str]:
    """`n` distinct requests drawn from all families (a seed gives the same list)."""
    rng = random.Random(seed)
    out: dict[str, None] = {}
    for _ in range(n * 50):
        if len(out) >= n:
            break
        out[_request(rng, rng.random())] = None
    return list(out)
