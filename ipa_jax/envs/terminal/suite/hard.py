"""Hard terminal tasks: multi-step fixes where later commands depend on what earlier ones printed (run a check, read
its complaint, inspect, fix, re-run), and discovery tasks (find which of several files has a property, then act on
it). The expert's steps hardcode what the instance makes them find, as a scripted expert does.
"""

from __future__ import annotations

import random
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ipa_jax.envs.terminal.spec import TerminalSpec
from ipa_jax.envs.terminal.suite._common import (
    DIRS,
    NAMES,
    RESULT_FILES,
    SERVICES,
    WORDS,
    Checks,
    Maker,
    Run,
    family_decorator,
    joined,
    phrase,
    shown,
    task,
    text_lines,
)

TIER = "hard"
FAMILIES: list[Maker] = []
family = family_decorator(TIER, FAMILIES)


def sed_replace(path: str, old: str, new: str) -> str:
    """A `sed -i` step replacing the literal text `old` by `new` (neither holds a newline or a single quote)."""
    pattern = re.sub(r"([\\/.*\[\]^$])", r"\\\1", old)
    replacement = re.sub(r"([\\/&])", r"\\\1", new)
    return f"sed -i 's/{pattern}/{replacement}/' {path}"


def distinct_texts(n: int, draw: Callable[[], str], key: Callable[[str], Any] = str) -> list[str]:
    """`n` results of `draw` that differ pairwise in `key` (drawing again on a clash)."""
    texts: list[str] = []
    while len(texts) < n:
        text = draw()
        if key(text) not in map(key, texts):
            texts.append(text)
    return texts


CONFIG_CHECK = """#!/bin/bash
# Every *_file setting in app.conf must name an existing file.
status=0
while IFS='=' read -r key value; do
  case "$key" in
    *_file) [ -f "$value" ] || { echo "FAIL: $key=$value does not exist"; status=1; } ;;
  esac
done < app.conf
[ $status = 0 ] && echo "OK: app.conf is valid"
exit $status
"""


@family
def config_path_fix(rng: random.Random) -> TerminalSpec:
    keys = rng.sample(("input_file", "template_file", "schema_file", "rules_file", "lookup_file"), 3)
    folders = rng.sample(DIRS, 3)
    paths = {
        key: f"{folder}/{rng.choice(WORDS)}_{rng.randint(2015, 2030)}.{rng.choice(('csv', 'json', 'tpl'))}"
        for key, folder in zip(keys, folders)
    }
    broken_key = rng.choice(keys)
    folder, name = paths[broken_key].split("/")
    stem_and_year, ext = name.rsplit(".", 1)
    stem, year = stem_and_year.rsplit("_", 1)
    wrong = f"{folder}/{stem}_{int(year) - rng.randint(1, 5)}.{ext}"
    decoy = f"{folder}/{rng.choice(('README.md', 'notes.txt', 'old.bak'))}"
    settings = [*paths.items(), ("name", rng.choice(WORDS)), ("port", str(rng.randint(1024, 9999)))]
    rng.shuffle(settings)

    def config(broken: bool) -> str:
        return joined(f"{key}={wrong if broken and key == broken_key else value}" for key, value in settings)

    out = rng.choice(RESULT_FILES)
    return task(
        f"./check.sh reports a broken setting in app.conf. Fix it to name the file of that type that exists "
        f"in the same folder (change nothing else), then save the output of ./check.sh to {out}.",
        files={
            "app.conf": config(broken=True),
            "check.sh": CONFIG_CHECK,
            decoy: phrase(rng, 4) + "\n",
            **{path: phrase(rng, 3) + "\n" for path in paths.values()},
        },
        executable=["check.sh"],
        solution=[
            shown("./check.sh"),
            f"ls {folder}",
            f"sed -i 's|^{broken_key}=.*|{broken_key}={paths[broken_key]}|' app.conf",
            f"./check.sh > {out}",
        ],
        checks=Checks(
            files={"app.conf": config(broken=False), "check.sh": CONFIG_CHECK, out: "OK: app.conf is valid\n"}
        ),
    )


@family
def incident_log_move(rng: random.Random) -> TerminalSpec:
    services = rng.sample(SERVICES, rng.randint(3, 6))
    broken = rng.choice(services)

    def request(status: int) -> str:
        return f"{rng.choice(('GET', 'POST', 'PUT'))} /{rng.choice(WORDS)}/{rng.randint(1, 99)} {status}"

    logs = {}
    for service in services:
        lines = [request(rng.choice((200, 201, 204, 301, 304, 400, 404))) for _ in range(rng.randint(3, 7))]
        if service == broken:
            lines.insert(rng.randint(0, len(lines)), request(500))
        logs[f"{service}.log"] = joined(lines)
    folder, out = rng.choice(("incidents", "quarantine", "review")), rng.choice(RESULT_FILES)
    bad = f"{broken}.log"
    return task(
        f"Exactly one file in logs/ has a request with status 500 (the last field). Move it into a new "
        f"folder {folder}/ and write its file name (without the folder) to {out}.",
        files={f"logs/{name}": text for name, text in logs.items()},
        solution=["grep -l ' 500$' logs/*", f"mkdir {folder} && mv logs/{bad} {folder}/", f"echo {bad} > {out}"],
        checks=Checks(
            files={
                **{f"logs/{name}": text for name, text in logs.items() if name != bad},
                f"{folder}/{bad}": logs[bad],
                out: bad + "\n",
            },
            absent=[f"logs/{bad}"],
        ),
    )


@dataclass(frozen=True)
class Function:
    """A small Python function for the bug-fix families: its correct source, the bug (the `correct` fragment
    replaced by `buggy`), and a draw of arguments for a test case."""

    source: str
    correct: str
    buggy: str
    draw_args: Callable[[random.Random], tuple[Any, ...]]

    @property
    def name(self) -> str:
        return self.source.split("(", 1)[0].removeprefix("def ")

    def implementation(self, with_bug: bool = False) -> Callable[..., Any]:
        """The function itself (our own constant source: expected results come from running it)."""
        namespace: dict[str, Any] = {}
        exec(self.source.replace(self.correct, self.buggy) if with_bug else self.source, namespace)
        return namespace[self.name]


def _numbers(rng: random.Random) -> list[int]:
    return [rng.randint(1, 60) for _ in range(rng.randint(2, 6))]


def _palindrome_or_not(rng: random.Random) -> str:
    half = "".join(rng.choices("abcdefghijklmnoprstu", k=rng.randint(2, 3)))
    word = half + half[-2::-1] if rng.random() < 0.6 else rng.choice(WORDS)
    return word.capitalize() if rng.random() < 0.7 else word


def _bounded(rng: random.Random) -> tuple[int, int, int]:
    low = rng.randint(0, 20)
    high = low + rng.randint(5, 30)
    return rng.randint(low - 10, high + 10), low, high


def _numbers_and_one_of_them(rng: random.Random) -> tuple[list[int], int]:
    values = _numbers(rng)
    return values, rng.choice(values)


def _text_and_limit(rng: random.Random) -> tuple[str, int]:
    text = phrase(rng, 2)
    return text, rng.randint(3, len(text) + 2)


NUMERIC_FUNCTIONS = (
    Function(
        "def total(values):\n    result = 0\n    for value in values:\n        result += value\n    return result\n",
        "for value in values:",
        "for value in values[1:]:",
        lambda rng: (_numbers(rng),),
    ),
    Function(
        "def average(values):\n    return round(sum(values) / len(values), 2)\n",
        "len(values), 2",
        "(len(values) + 1), 2",
        lambda rng: (_numbers(rng),),
    ),
    Function(
        "def clamp(value, low, high):\n    return max(low, min(value, high))\n",
        "min(value, high)",
        "min(value, low)",
        _bounded,
    ),
    Function(
        "def count_above(values, limit):\n    return sum(1 for value in values if value > limit)\n",
        "value > limit",
        "value >= limit",
        _numbers_and_one_of_them,
    ),
    Function(
        "def percent(part, whole):\n    return round(100 * part / whole, 1)\n",
        "100 * part / whole",
        "100 * whole / part",
        lambda rng: (rng.randint(1, 99), rng.randint(100, 400)),
    ),
    Function(
        "def spread(values):\n    return max(values) - min(values)\n",
        "max(values) - min(values)",
        "min(values) - max(values)",
        lambda rng: (_numbers(rng),),
    ),
)
TEXT_FUNCTIONS = (
    Function(
        'def initials(name):\n    return "".join(word[0].upper() for word in name.split())\n',
        "word[0].upper()",
        "word[0]",
        lambda rng: (" ".join(rng.sample(NAMES, rng.randint(2, 3))),),
    ),
    Function(
        'def slugify(title):\n    return "-".join(title.lower().split())\n',
        '"-".join',
        '"_".join',
        lambda rng: (" ".join(w.capitalize() for w in rng.sample(WORDS, 3)),),
    ),
    Function(
        "def is_palindrome(word):\n    text = word.lower()\n    return text == text[::-1]\n",
        "text = word.lower()",
        "text = word",
        lambda rng: (_palindrome_or_not(rng),),
    ),
    Function(
        'def count_vowels(text):\n    return sum(1 for ch in text.lower() if ch in "aeiou")\n',
        '"aeiou"',
        '"aeio"',
        lambda rng: (phrase(rng, 2),),
    ),
    Function(
        'def truncate(text, limit):\n    return text if len(text) <= limit else text[:limit] + "..."\n',
        "text[:limit]",
        "text[:limit - 1]",
        _text_and_limit,
    ),
    Function(
        'def capitalize_words(text):\n    return " ".join(word.capitalize() for word in text.split())\n',
        "word.capitalize()",
        "word.upper()",
        lambda rng: (phrase(rng, rng.randint(2, 3)),),
    ),
)


def unittest_source(module: str, calls: list[tuple[str, str, str]]) -> str:
    """A unittest file checking `function(args) == expected` for each (function, args, expected) call."""
    functions = list(dict.fromkeys(function for function, _, _ in calls))
    lines = [
        "import unittest",
        "",
        f"from {module} import {', '.join(functions)}",
        "",
        "",
        f"class Test{module.title().replace('_', '')}(unittest.TestCase):",
    ]
    for function in functions:
        lines.append(f"    def test_{function}(self):")
        lines += [f"        self.assertEqual({f}({args}), {expected})" for f, args, expected in calls if f == function]
        lines.append("")
    lines += ["", 'if __name__ == "__main__":', "    unittest.main()"]
    return joined(lines)


def cases(rng: random.Random, function: Function, is_buggy: bool) -> list[tuple[str, str, str]]:
    """Three (name, args, expected) test calls of `function`; for the buggy one, at least one call catches the bug."""
    correct, broken = function.implementation(), function.implementation(with_bug=True)
    while True:
        drawn = [function.draw_args(rng) for _ in range(3)]
        if not is_buggy or any(correct(*args) != broken(*args) for args in drawn):
            return [(function.name, ", ".join(map(repr, args)), repr(correct(*args))) for args in drawn]


def hidden_calls(module: str, calls: list[tuple[str, str, str]]) -> Run:
    """A run printing `repr(function(args))` of each (function, args, expected) call of `module`, which must print the
    expected values: the host compares them, so the module (which runs in that process) never sees them, and a module
    that ends the process early prints nothing."""
    code = f"import {module}\n" + "".join(f"print(repr({module}.{f}({args})))\n" for f, args, _ in calls)
    return Run(f"python3 -c {shlex.quote(code)}", joined(expected for _, _, expected in calls))


def python_bugfix(rng: random.Random, pool: tuple[Function, ...], modules: tuple[str, ...]) -> TerminalSpec:
    """A module of three functions, one with a bug, and its failing unittest file; also graded by hidden calls."""
    module = rng.choice(modules)
    functions = rng.sample(pool, 3)
    buggy = rng.choice(functions)
    source = f'"""Helpers of the {rng.choice(WORDS)} project."""\n\n\n' + "\n\n".join(f.source for f in functions)
    broken_source = source.replace(buggy.correct, buggy.buggy)
    assert broken_source.count(buggy.buggy) == 1, f"the bug of {buggy.name} is not unique in its module"
    visible = unittest_source(module, [c for f in functions for c in cases(rng, f, f is buggy)])
    hidden = [c for f in functions for c in cases(rng, f, f is buggy)]
    test_file = f"test_{module}.py"
    return task(
        f"python3 {test_file} fails. Find and fix the bug in {module}.py (do not change {test_file}) so that "
        f"the tests pass.",
        files={f"{module}.py": broken_source, test_file: visible},
        solution=[
            shown(f"python3 {test_file}"),
            f"grep -n -A4 'def {buggy.name}' {module}.py",
            sed_replace(f"{module}.py", buggy.buggy, buggy.correct),
            f"python3 {test_file}",
        ],
        checks=Checks(files={test_file: visible}, runs=[Run(f"python3 {test_file}"), hidden_calls(module, hidden)]),
    )


@family
def fix_python_numeric(rng: random.Random) -> TerminalSpec:
    return python_bugfix(rng, NUMERIC_FUNCTIONS, ("mathutils", "calc", "metrics", "numeric"))


@family
def fix_python_text(rng: random.Random) -> TerminalSpec:
    return python_bugfix(rng, TEXT_FUNCTIONS, ("textutils", "formatting", "wordtools", "strings_lib"))


@family
def largest_file_archive(rng: random.Random) -> TerminalSpec:
    folder, archive = rng.sample(DIRS, 2)
    names = [f"{stem}.txt" for stem in rng.sample(WORDS, rng.randint(4, 6))]
    texts = distinct_texts(len(names), lambda: joined(text_lines(rng, rng.randint(1, 12))), key=len)
    files = {f"{folder}/{name}": text for name, text in zip(names, texts)}
    largest = max(zip(texts, names), key=lambda pair: len(pair[0]))[1]
    out = rng.choice(RESULT_FILES)
    return task(
        f"Move the largest file (in bytes) in {folder}/ into a new folder {archive}/ and write its file name "
        f"(without the folder) to {out}.",
        files=files,
        solution=[
            f"wc -c {folder}/*",
            f"mkdir {archive} && mv {folder}/{largest} {archive}/",
            f"echo {largest} > {out}",
        ],
        checks=Checks(
            files={
                **{path: text for path, text in files.items() if path != f"{folder}/{largest}"},
                f"{archive}/{largest}": files[f"{folder}/{largest}"],
                out: largest + "\n",
            },
            absent=[f"{folder}/{largest}"],
        ),
    )


@family
def permission_fix_run(rng: random.Random) -> TerminalSpec:
    helpers = [f"bin/{stem}.sh" for stem in rng.sample(WORDS, rng.randint(2, 4))]
    scripts = {"run.sh": joined(["#!/bin/bash", "set -e", *(f"./{helper}" for helper in helpers)])}
    output = []
    for helper, label in zip(helpers, rng.sample(NAMES, len(helpers))):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        scripts[helper] = f'#!/bin/bash\necho "{label}: $(( {a} + {b} ))"\n'
        output.append(f"{label}: {a + b}")
    blocked = rng.choice(helpers)
    out = rng.choice(RESULT_FILES)
    return task(
        f"./run.sh fails. Find out why and fix it without editing any script, then save the output of "
        f"./run.sh to {out}.",
        files=scripts,
        executable=[s for s in scripts if s != blocked],
        solution=[shown("./run.sh"), f"chmod +x {blocked}", f"./run.sh > {out}"],
        checks=Checks(files={**scripts, out: joined(output)}, executable=list(scripts)),
    )


@family
def duplicate_file_cleanup(rng: random.Random) -> TerminalSpec:
    folder = rng.choice(DIRS)
    names = [f"{stem}.txt" for stem in rng.sample(WORDS, rng.randint(4, 6))]
    texts = distinct_texts(len(names) - 1, lambda: joined(text_lines(rng, rng.randint(1, 4))))
    first, second = sorted(rng.sample(range(len(names)), 2))
    texts.insert(second, texts[first])
    files = {f"{folder}/{name}": text for name, text in zip(names, texts)}
    kept, removed = sorted((names[first], names[second]))
    out = rng.choice(RESULT_FILES)
    return task(
        f"Two files in {folder}/ have identical contents. Delete the one whose name sorts later "
        f"alphabetically and write the name of the one you kept (without the folder) to {out}.",
        files=files,
        solution=[f"md5sum {folder}/* | sort", f"rm {folder}/{removed}", f"echo {kept} > {out}"],
        checks=Checks(
            files={**{p: t for p, t in files.items() if p != f"{folder}/{removed}"}, out: kept + "\n"},
            absent=[f"{folder}/{removed}"],
        ),
    )


@family
def bad_csv_row(rng: random.Random) -> TerminalSpec:
    key, value = rng.choice((("name", "amount"), ("item", "quantity"), ("city", "visitors")))
    names = rng.sample(NAMES if key == "name" else WORDS, rng.randint(5, 10))
    numbers = [rng.randint(1, 400) for _ in names]
    bad_row, bad_value = rng.randrange(len(names)), rng.choice(("n/a", "none", "?", "TBD", "unknown", "-"))
    rows = [f"{name},{bad_value if i == bad_row else number}" for i, (name, number) in enumerate(zip(names, numbers))]
    data, script, out = rng.choice(("data.csv", "records.csv")), "report.py", rng.choice(RESULT_FILES)
    report = (
        f'import csv\n\nwith open("{data}") as f:\n    rows = list(csv.DictReader(f))\n'
        f'total = sum(int(row["{value}"]) for row in rows)\nprint("rows:", len(rows))\nprint("total:", total)\n'
    )
    header = f"{key},{value}"
    broken, clean = joined([header, *rows]), joined([header, *rows[:bad_row], *rows[bad_row + 1 :]])
    return task(
        f"{script} crashes on one row of {data}. Delete that row from {data} (change nothing else), then "
        f"save the output of `python3 {script}` to {out}.",
        files={data: broken, script: report},
        solution=[
            shown(f"python3 {script}"),
            f"grep -nF ',{bad_value}' {data}",
            f"sed -i '{bad_row + 2}d' {data}",
            f"python3 {script} > {out}",
        ],
        checks=Checks(
            files={
                data: clean,
                script: report,
                out: f"rows: {len(rows) - 1}\ntotal: {sum(numbers) - numbers[bad_row]}\n",
            }
        ),
    )


@family
def disable_service_on_port(rng: random.Random) -> TerminalSpec:
    services = rng.sample(SERVICES, rng.randint(3, 6))
    ports = rng.sample(range(1024, 10000), len(services))
    target = rng.randrange(len(services))

    def conf(i: int, enabled: bool) -> str:
        return joined(
            [f"name={services[i]}", f"port={ports[i]}", f"enabled={str(enabled).lower()}", f"user={services[i]}_svc"]
        )

    enabled = [i == target or rng.random() < 0.7 for i in range(len(services))]
    files = {f"services/{services[i]}.conf": conf(i, enabled[i]) for i in range(len(services))}
    out = rng.choice(RESULT_FILES)
    return task(
        f"Disable the service that listens on port {ports[target]}: set enabled=false in its file in "
        f"services/ (change nothing else), and write its name (the file name without .conf) to {out}.",
        files=files,
        solution=[
            f"grep -l '^port={ports[target]}$' services/*.conf",
            f"sed -i 's/^enabled=true$/enabled=false/' services/{services[target]}.conf",
            f"echo {services[target]} > {out}",
        ],
        checks=Checks(
            files={**files, f"services/{services[target]}.conf": conf(target, False), out: services[target] + "\n"}
        ),
    )


@family
def block_top_offender(rng: random.Random) -> TerminalSpec:
    users = rng.sample(NAMES, rng.randint(6, 8))
    attackers, already_blocked = users[: rng.randint(2, 4)], users[-rng.randint(1, 2) :]
    failures = dict(zip(attackers, rng.sample(range(1, 7), len(attackers))))  # distinct: one clear maximum
    events = [f"Failed password for {user}" for user, n in failures.items() for _ in range(n)]
    events += [f"Accepted password for {rng.choice(users)}" for _ in range(rng.randint(2, 4))]
    rng.shuffle(events)
    times = sorted(rng.sample(range(86400), len(events)))
    lines = [
        f"{t // 3600:02d}:{t // 60 % 60:02d}:{t % 60:02d} sshd: {event} from 10.0.{rng.randint(0, 255)}."
        f"{rng.randint(1, 254)}"
        for t, event in zip(times, events)
    ]
    top = max(failures, key=failures.__getitem__)
    blocklist = rng.choice(("blocked.txt", "denylist.txt", "banned.txt"))
    return task(
        f"Find the user with the most 'Failed password' lines in auth.log and append their name to "
        f"{blocklist} (keep its existing lines).",
        files={"auth.log": joined(lines), blocklist: joined(already_blocked)},
        solution=[
            "grep 'Failed password' auth.log | awk '{print $6}' | sort | uniq -c | sort -rn | head -3",
            f"echo {top} >> {blocklist}",
            f"cat {blocklist}",
        ],
        checks=Checks(files={"auth.log": joined(lines), blocklist: joined([*already_blocked, top])}),
    )


@family
def version_bump(rng: random.Random) -> TerminalSpec:
    major, minor, patch = rng.randint(0, 9), rng.randint(0, 30), rng.randint(1, 30)
    old = f"{major}.{minor}.{patch}"
    previous = f"{major}.{minor}.{patch - 1}"
    new = rng.choice((f"{major}.{minor}.{patch + 1}", f"{major}.{minor + 1}.0", f"{major + 1}.0.0"))
    project = rng.choice(WORDS)
    mentions = {  # path -> text with VERSION where the version appears
        "VERSION": "VERSION\n",
        "setup.cfg": f"[metadata]\nname = {project}\nversion = VERSION\n",
        "README.md": f"# {project}\n\nCurrent release: VERSION\n\n{phrase(rng, 6)}\n",
        "docs/install.md": f"# Install\n\npip install {project}==VERSION\n",
        f"src/{project}/__init__.py": '__version__ = "VERSION"\n',
    }
    changed = sorted(rng.sample(sorted(mentions), rng.randint(2, 4)))
    others = {
        "docs/history.md": f"# History\n\n## {previous}\n\n- {phrase(rng, 4)}\n",
        "notes.txt": joined(text_lines(rng, 3)),
    }
    out = rng.choice(("changed.txt", "bumped.txt"))
    return task(
        f"The version changes from {old} to {new}. Replace {old} with {new} in every file that contains it, "
        f"and write the changed files' paths (relative to /app, sorted, one per line) to {out}.",
        files={**{path: mentions[path].replace("VERSION", old) for path in changed}, **others},
        solution=[
            f"grep -rlF '{old}' . | sort",
            f"sed -i 's/{re.escape(old)}/{new}/g' {' '.join(changed)}",
            f"printf '%s\\n' {' '.join(changed)} > {out}",
        ],
        checks=Checks(
            files={**{path: mentions[path].replace("VERSION", new) for path in changed}, **others, out: joined(changed)}
        ),
    )


MODULE_RENAMES = (
    ("report_utils", "reportutils"),
    ("numtools", "num_tools"),
    ("helpers", "helper"),
    ("formatting", "formatters"),
)  # (the module's file, what main.py imports)
FUNCTION_RENAMES = (
    ("format_total", "fmt_total"),
    ("summarize", "summarise"),
    ("describe", "describe_all"),
    ("render_sum", "render_total"),
)


@family
def fix_python_import(rng: random.Random) -> TerminalSpec:
    module, wrong_module = rng.choice(MODULE_RENAMES)
    function, wrong_function = rng.choice(FUNCTION_RENAMES)
    label, numbers = rng.choice(WORDS), [rng.randint(1, 99) for _ in range(rng.randint(2, 6))]
    helper = f'def {function}(values):\n    return "{label}: " + str(sum(values))\n'

    def main(imported_module: str, imported_function: str) -> str:
        return f"from {imported_module} import {imported_function}\n\nprint({imported_function}({numbers}))\n"

    if rng.random() < 0.5:
        broken, inspect, fix = main(wrong_module, function), "ls *.py", sed_replace("main.py", wrong_module, module)
    else:
        broken, inspect = main(module, wrong_function), f"grep -n '^def' {module}.py"
        fix = f"sed -i 's/{wrong_function}/{function}/g' main.py"
    expected, out = f"{label}: {sum(numbers)}\n", rng.choice(RESULT_FILES)
    return task(
        f"python3 main.py fails. Fix main.py (only main.py) so that it runs, then save its output to {out}.",
        files={"main.py": broken, f"{module}.py": helper},
        solution=[shown("python3 main.py"), inspect, fix, f"python3 main.py > {out}"],
        checks=Checks(files={f"{module}.py": helper, out: expected}, runs=[Run("python3 main.py", expected)]),
    )


MANIFEST_CHECK = """#!/bin/bash
# manifest.txt lists `file lines` for every file in FOLDER/.
status=0
count=0
while read -r name expected; do
  actual=$(wc -l < "FOLDER/$name")
  if [ "$actual" != "$expected" ]; then
    echo "MISMATCH $name: manifest says $expected, file has $actual"
    status=1
  fi
  count=$((count + 1))
done < manifest.txt
[ $status = 0 ] && echo "OK: $count files verified"
exit $status
"""


@family
def manifest_count_fix(rng: random.Random) -> TerminalSpec:
    folder = rng.choice(DIRS)
    names = [f"{stem}.txt" for stem in rng.sample(WORDS, rng.randint(3, 6))]
    contents = {name: text_lines(rng, rng.randint(2, 15)) for name in names}
    wrong = {name: len(contents[name]) + rng.choice((-2, -1, 1, 2, 3)) for name in rng.sample(names, rng.randint(1, 2))}

    def manifest(counts: dict[str, int]) -> str:
        return joined(f"{name} {counts.get(name, len(contents[name]))}" for name in names)

    verify = MANIFEST_CHECK.replace("FOLDER", folder)
    out = rng.choice(RESULT_FILES)
    fixes = " ".join(f"-e 's/^{name} {count}$/{name} {len(contents[name])}/'" for name, count in wrong.items())
    return task(
        f"./verify.sh reports a mismatch. The files in {folder}/ are right: fix manifest.txt, then save the "
        f"output of ./verify.sh to {out}.",
        files={
            "manifest.txt": manifest(wrong),
            "verify.sh": verify,
            **{f"{folder}/{name}": joined(lines) for name, lines in contents.items()},
        },
        executable=["verify.sh"],
        solution=[shown("./verify.sh"), f"sed -i {fixes} manifest.txt", f"./verify.sh > {out}"],
        checks=Checks(
            files={"manifest.txt": manifest({}), "verify.sh": verify, out: f"OK: {len(names)} files verified\n"}
        ),
    )
