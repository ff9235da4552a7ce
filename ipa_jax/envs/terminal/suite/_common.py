"""What the suite's families share: word pools, the `family` registration decorator, and the checks that grade them.

Every family is graded by `Checks` the host compares (`TerminalSpec.checks`, see ipa_jax/envs/terminal/grader.py):
files with exact contents, files that must be gone or executable, and commands whose exit status and stdout must
match. Contents and stdout are compared exactly, apart from one final newline (`echo 5 > n.txt` and `printf 5 >
n.txt` both pass). Inputs the agent must not see (a second data file a script is tried on) are mounted for those
commands only, at /tests/inputs/<name>; the expected contents and outputs stay on the host, so a program the checks
run can read its input but not the answer.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ipa_jax.envs.terminal.grader import INPUTS_MOUNT
from ipa_jax.envs.terminal.spec import TerminalSpec

Maker = Callable[[random.Random], TerminalSpec]

INPUTS_DIR = INPUTS_MOUNT  # hidden inputs, as the commands the checks run see them


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

    def to_dict(self) -> dict[str, Any]:
        """As `TerminalSpec.checks`."""
        return {
            "files": dict(self.files),
            "absent": list(self.absent),
            "executable": list(self.executable),
            "runs": [dataclasses.asdict(run) for run in self.runs],
            "inputs": dict(self.inputs),
        }


def task(
    instruction: str, files: Mapping[str, str], solution: Sequence[str], checks: Checks, executable: Sequence[str] = ()
) -> TerminalSpec:
    """A TerminalSpec whose name, tier and family the `family` decorator fills in."""
    return TerminalSpec(
        name="",
        instruction=instruction,
        files=files,
        checks=checks.to_dict(),
        solution=tuple(solution),
        executable=tuple(executable),
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
