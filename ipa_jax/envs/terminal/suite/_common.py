"""What the suite's families share: word pools, the `family` registration decorator, and one grader.

Every family's grader is the same small Python checker (`CHECK_SCRIPT`, run by `test.sh`) reading the instance's
expectations from /tests/expect.json: files with exact contents, files that must be gone or executable, and
commands whose exit status and stdout must match. Contents and stdout are compared exactly, apart from one final
newline (`echo 5 > n.txt` and `printf 5 > n.txt` both pass). Inputs the agent must not see (a second data file a
script is tried on) travel with the tests, at /tests/inputs/<name>.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ipa_jax.envs.terminal.grader import TESTS_MOUNT
from ipa_jax.envs.terminal.spec import TEST_ENTRY, TerminalSpec

Maker = Callable[[random.Random], TerminalSpec]

INPUTS_FOLDER = "inputs"
INPUTS_DIR = f"{TESTS_MOUNT}/{INPUTS_FOLDER}"  # hidden inputs, as the grader sees them


def _substring_free(words: str) -> tuple[str, ...]:
    """The words of a pool, dropping any that occurs inside another: then `grep WORD` or `sed s/WORD/` on text made
    of pool words only ever matches that word."""
    pool = words.split()
    return tuple(w for w in pool if not any(w != other and w in other for other in pool))


WORDS = _substring_free("""
    apple river stone cloud tiger lemon piano rocket garden candle forest island mirror pencil saddle turtle violin
    wagon zebra anchor basket cactus dragon engine falcon glacier hammer jacket kettle ladder magnet napkin orange
    parrot quartz rabbit salmon tomato umbrella valley walrus yogurt bridge castle desert feather guitar harbor igloo
    jungle koala lantern meadow needle oyster pepper puzzle ribbon spider tunnel velvet window beacon cobalt dolphin
    fossil goblet hazel ivory jasper lotus marble nectar onion pebble quill raven sparrow thistle walnut
""")
NAMES = _substring_free("""
    alice bruno carla diego elena felix greta hugo irene jonas karim laura marco nadia oscar paula quinn rosa sven
    tara umar vera wanda xavier yusuf zoe boris chloe dmitri esther farid gloria hector ingrid julia kenji lucia
""")
CITIES = _substring_free("paris oslo lima cairo delhi tokyo quito rome seoul dakar hanoi kyiv riga bern doha minsk")
SERVICES = _substring_free("""
    api auth billing cache gateway mailer search worker scheduler storage payments frontend metrics queue
""")
RESULT_FILES = ("answer.txt", "result.txt", "out.txt", "report.txt")  # where medium and hard tasks put a result
DIRS = _substring_free("data docs notes reports archive backup files inbox output records exports assets")


def phrase(rng: random.Random, n_words: int) -> str:
    """`n_words` pool words joined by spaces (repeats allowed)."""
    return " ".join(rng.choices(WORDS, k=n_words))


def text_lines(rng: random.Random, n_lines: int, words_per_line: tuple[int, int] = (2, 5)) -> list[str]:
    return [phrase(rng, rng.randint(*words_per_line)) for _ in range(n_lines)]


def lines_with_word(rng: random.Random) -> tuple[str, list[str], list[bool]]:
    """A word, lines of other words, and which lines contain the word (at least one does, at least one doesn't)."""
    word, *others = rng.sample(WORDS, 12)
    lines = [" ".join(rng.choices(others, k=rng.randint(2, 5))) for _ in range(rng.randint(6, 14))]
    has_word = [False] * len(lines)
    for i in rng.sample(range(len(lines)), rng.randint(1, len(lines) - 1)):
        words = lines[i].split()
        words.insert(rng.randint(0, len(words)), word)
        lines[i], has_word[i] = " ".join(words), True
    return word, lines, has_word


def joined(lines: Iterable[str]) -> str:
    """Lines as file text: one per line, with a final newline."""
    return "".join(f"{line}\n" for line in lines)


def shown(command: str) -> str:
    """An expert step running a command that fails before the fix: the end of its output, errors included, is shown
    and the step itself exits 0."""
    return f"{command} 2>&1 | tail -n 15"


@dataclass(frozen=True)
class Run:
    """A command the grader runs in /app: it must exit with `exit_code` and, unless None, print `stdout`."""

    command: str
    stdout: str | None = None
    exit_code: int = 0


@dataclass(frozen=True)
class Checks:
    """What a solved instance looks like (see the module docstring)."""

    files: Mapping[str, str] = field(default_factory=dict)
    absent: Sequence[str] = ()
    executable: Sequence[str] = ()
    runs: Sequence[Run] = ()
    inputs: Mapping[str, str] = field(default_factory=dict)

    def tests(self) -> dict[str, str]:
        expect = {
            "files": dict(self.files),
            "absent": list(self.absent),
            "executable": list(self.executable),
            "runs": [dataclasses.asdict(run) for run in self.runs],
        }
        inputs = {f"{INPUTS_FOLDER}/{name}": text for name, text in self.inputs.items()}
        return {TEST_ENTRY: TEST_SH, "check.py": CHECK_SCRIPT, "expect.json": json.dumps(expect, indent=1), **inputs}


def task(
    instruction: str, files: Mapping[str, str], solution: Sequence[str], checks: Checks, executable: Sequence[str] = ()
) -> TerminalSpec:
    """A TerminalSpec whose name, tier and family the `family` decorator fills in."""
    # The checker runs the agent's programs: graded by its exit status, with no /logs they could write a reward to.
    return TerminalSpec(
        name="",
        instruction=instruction,
        files=files,
        tests=checks.tests(),
        solution=tuple(solution),
        executable=tuple(executable),
        reward_file=False,
    )


def family_decorator(tier: str, registry: list[Maker]) -> Callable[[Maker], Maker]:
    """`@family` for one tier's module: the spec is named after the function, gets the tier, and the function is
    appended to the module's `registry`."""

    def family(draw: Maker) -> Maker:
        @functools.wraps(draw)
        def make(rng: random.Random) -> TerminalSpec:
            return dataclasses.replace(draw(rng), name=draw.__name__, tier=tier, family=draw.__name__)

        registry.append(make)
        return make

    return family


TEST_SH = f"python3 {TESTS_MOUNT}/check.py {TESTS_MOUNT}/expect.json\n"

CHECK_SCRIPT = '''"""Terminal-suite grader: exit 0 iff every expectation in expect.json holds in the current folder."""
import json
import os
import subprocess
import sys


# The agent's programs run as in the workspace: their own folder on Python's path (the grader's Python has none).
PROGRAM_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONSAFEPATH", "PYTHONPATH")}


def same(actual, expected):
    return actual.removesuffix("\\n") == expected.removesuffix("\\n")


def failures(expect):
    for path, text in expect["files"].items():
        try:
            with open(path, encoding="utf-8") as f:
                actual = f.read()
        except (OSError, UnicodeDecodeError) as e:
            yield f"{path}: cannot read it ({e.__class__.__name__})"
            continue
        if not same(actual, text):
            yield f"{path}: wrong content"
    for path in expect["absent"]:
        if os.path.lexists(path):
            yield f"{path}: should not exist"
    for path in expect["executable"]:
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            yield f"{path}: not an executable file"
    for run in expect["runs"]:
        try:
            done = subprocess.run(["bash", "-c", run["command"]], capture_output=True, text=True, timeout=10,
                                  env=PROGRAM_ENV)
        except subprocess.TimeoutExpired:
            yield f"{run['command']}: timed out"
            continue
        if done.returncode != run["exit_code"]:
            yield f"{run['command']}: exit status {done.returncode}, expected {run['exit_code']}"
        elif run["stdout"] is not None and not same(done.stdout, run["stdout"]):
            yield f"{run['command']}: wrong output"


with open(sys.argv[1], encoding="utf-8") as f:
    problems = list(failures(json.load(f)))
for problem in problems:
    print("FAIL", problem)
print("PASS" if not problems else f"{len(problems)} check(s) failed")
sys.exit(1 if problems else 0)
'''
