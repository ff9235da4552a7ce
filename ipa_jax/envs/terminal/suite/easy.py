"""Easy terminal tasks: file and text manipulation solved with one or two standard commands (create, rename and move
files, count lines and words, extract a column, replace a word, sort, find by extension, head/tail, concatenate,
permissions)."""

from __future__ import annotations

import random

from ipa_jax.envs.terminal.spec import TerminalSpec
from ipa_jax.envs.terminal.suite._common import (
    CITIES,
    DIRS,
    NAMES,
    WORDS,
    Checks,
    Maker,
    family_decorator,
    joined,
    lines_with_word,
    phrase,
    task,
    text_lines,
)

TIER = "easy"
FAMILIES: list[Maker] = []
family = family_decorator(TIER, FAMILIES)

RESULT_FILES = ("answer.txt", "result.txt", "out.txt", "output.txt")
SEARCH_EXTENSIONS = ("py", "md", "cfg", "sh", "csv", "json", "yaml", "ini", "log")


def text_file(rng: random.Random, n_lines: tuple[int, int] = (5, 15)) -> tuple[str, list[str]]:
    """A .txt file name and its lines of pool words."""
    return f"{rng.choice(WORDS)}.txt", text_lines(rng, rng.randint(*n_lines))


@family
def create_file(rng: random.Random) -> TerminalSpec:
    folder = rng.choice(("", "", *DIRS))
    path = f"{folder}/{rng.choice(WORDS)}.txt" if folder else f"{rng.choice(WORDS)}.txt"
    line = phrase(rng, rng.randint(3, 6))
    mkdir = f"mkdir -p {folder} && " if folder else ""
    return task(
        f"Create the file {path} (create folders as needed) containing exactly one line: {line}",
        files={},
        solution=[f"{mkdir}echo '{line}' > {path}"],
        checks=Checks(files={path: line + "\n"}),
    )


@family
def rename_file(rng: random.Random) -> TerminalSpec:
    old_stem, new_stem = rng.sample(WORDS, 2)
    old, new = f"{old_stem}.{rng.choice(('txt', 'md', 'log'))}", f"{new_stem}.{rng.choice(('txt', 'md', 'bak'))}"
    content = joined(text_lines(rng, rng.randint(2, 6)))
    return task(
        f"Rename {old} to {new}.",
        files={old: content},
        solution=[f"mv {old} {new}"],
        checks=Checks(files={new: content}, absent=[old]),
    )


@family
def move_by_extension(rng: random.Random) -> TerminalSpec:
    moved_ext, kept_ext = rng.sample(("log", "txt", "csv", "md", "json"), 2)
    folder = rng.choice(DIRS)
    n_moved, n_kept = rng.randint(2, 4), rng.randint(1, 3)
    stems = rng.sample(WORDS, n_moved + n_kept)
    moved = {f"{s}.{moved_ext}": phrase(rng, 3) + "\n" for s in stems[:n_moved]}
    kept = {f"{s}.{kept_ext}": phrase(rng, 3) + "\n" for s in stems[n_moved:]}
    return task(
        f"Move every .{moved_ext} file in /app into a new folder {folder}/. Leave the other files in place.",
        files={**moved, **kept},
        solution=[f"mkdir {folder} && mv *.{moved_ext} {folder}/"],
        checks=Checks(files={**{f"{folder}/{name}": text for name, text in moved.items()}, **kept}, absent=list(moved)),
    )


@family
def count_lines(rng: random.Random) -> TerminalSpec:
    name, lines = text_file(rng, (5, 40))
    out = rng.choice(RESULT_FILES)
    return task(
        f"Write the number of lines in {name} to {out} (just the number).",
        files={name: joined(lines)},
        solution=[f"wc -l < {name} > {out}"],
        checks=Checks(files={out: f"{len(lines)}\n"}),
    )


@family
def count_matching_lines(rng: random.Random) -> TerminalSpec:
    word, lines, has_word = lines_with_word(rng)
    name, out = f"{rng.choice(WORDS)}.txt", rng.choice(RESULT_FILES)
    return task(
        f"Write the number of lines in {name} that contain the word {word} to {out} (just the number).",
        files={name: joined(lines)},
        solution=[f"grep -c {word} {name} > {out}"],
        checks=Checks(files={out: f"{sum(has_word)}\n"}),
    )


@family
def extract_column(rng: random.Random) -> TerminalSpec:
    value_makers = {
        "name": lambda: rng.choice(NAMES),
        "city": lambda: rng.choice(CITIES),
        "age": lambda: str(rng.randint(18, 80)),
        "score": lambda: str(rng.randint(0, 100)),
        "team": lambda: rng.choice(WORDS),
        "level": lambda: str(rng.randint(1, 9)),
    }
    header = rng.sample(sorted(value_makers), rng.randint(3, 5))
    rows = [[value_makers[col]() for col in header] for _ in range(rng.randint(5, 10))]
    column = rng.randrange(len(header))
    name, out = rng.choice(("data.csv", "people.csv", "table.csv")), rng.choice(RESULT_FILES)
    return task(
        f"{name} is comma-separated with a header line. Write the values of its {header[column]} column "
        f"(no header) to {out}, one per line, in file order.",
        files={name: joined(",".join(row) for row in [header, *rows])},
        solution=[f"cut -d, -f{column + 1} {name} | tail -n +2 > {out}"],
        checks=Checks(files={out: joined(row[column] for row in rows)}),
    )


@family
def replace_word(rng: random.Random) -> TerminalSpec:
    old, new, *others = rng.sample(WORDS, 12)
    lines = [rng.choices(others, k=rng.randint(2, 5)) for _ in range(rng.randint(4, 10))]
    for _ in range(rng.randint(2, 5)):
        line = rng.choice(lines)
        line.insert(rng.randint(0, len(line)), old)
    name = f"{rng.choice(others)}.txt"
    text = joined(" ".join(line) for line in lines)
    return task(
        f"Replace every occurrence of the word {old} with {new} in {name} (edit the file in place).",
        files={name: text},
        solution=[f"sed -i 's/{old}/{new}/g' {name}"],
        checks=Checks(files={name: text.replace(old, new)}),
    )


@family
def sort_unique(rng: random.Random) -> TerminalSpec:
    distinct = rng.sample(rng.choice((WORDS, NAMES)), rng.randint(4, 8))
    lines = distinct + rng.choices(distinct, k=rng.randint(3, 8))
    rng.shuffle(lines)
    name, out = rng.choice(("list.txt", "names.txt", "items.txt", "words.txt")), rng.choice(RESULT_FILES)
    return task(
        f"Write the distinct lines of {name}, sorted alphabetically, to {out}.",
        files={name: joined(lines)},
        solution=[f"sort -u {name} > {out}"],
        checks=Checks(files={out: joined(sorted(distinct))}),
    )


@family
def find_by_extension(rng: random.Random) -> TerminalSpec:
    target, *other_exts = rng.sample(SEARCH_EXTENSIONS, 4)
    top = rng.sample(DIRS, 2)
    folders = ["", *top, f"{top[0]}/{rng.choice(WORDS)}"]
    n_target, n_other = rng.randint(2, 4), rng.randint(2, 5)
    stems = rng.sample(WORDS, n_target + n_other)
    exts = [target] * n_target + [rng.choice(other_exts) for _ in range(n_other)]
    paths = [f"{rng.choice(folders)}/{stem}.{ext}".lstrip("/") for stem, ext in zip(stems, exts)]
    out = "found.txt"
    return task(
        f"List every .{target} file under /app (any depth) in {out}: one path per line, relative to /app "
        f"without a leading ./ (like docs/a.{target}), sorted.",
        files={path: phrase(rng, 3) + "\n" for path in paths},
        solution=[f"find . -name '*.{target}' -printf '%P\\n' | sort > {out}"],
        checks=Checks(files={out: joined(sorted(p for p in paths if p.endswith(f".{target}")))}),
    )


@family
def head_tail(rng: random.Random) -> TerminalSpec:
    name, lines = text_file(rng, (12, 30))
    count, first = rng.randint(2, 8), rng.random() < 0.5
    out = rng.choice(RESULT_FILES)
    which, command, expected = ("first", "head", lines[:count]) if first else ("last", "tail", lines[-count:])
    return task(
        f"Write the {which} {count} lines of {name} to {out}.",
        files={name: joined(lines)},
        solution=[f"{command} -n {count} {name} > {out}"],
        checks=Checks(files={out: joined(expected)}),
    )


@family
def concatenate_files(rng: random.Random) -> TerminalSpec:
    parts = [f"{stem}.txt" for stem in rng.sample(WORDS, rng.randint(2, 4))]
    contents = {part: joined(text_lines(rng, rng.randint(1, 4))) for part in parts}
    out = rng.choice(("all.txt", "combined.txt", "merged.txt"))
    listed = f"{', '.join(parts[:-1])} and {parts[-1]}"
    return task(
        f"Concatenate {listed}, in that order, into {out}.",
        files=contents,
        solution=[f"cat {' '.join(parts)} > {out}"],
        checks=Checks(files={out: "".join(contents[part] for part in parts)}),
    )


@family
def make_executable(rng: random.Random) -> TerminalSpec:
    script, out = f"{rng.choice(WORDS)}.sh", rng.choice(RESULT_FILES)
    greeting, a, b = phrase(rng, 3), rng.randint(2, 99), rng.randint(2, 99)
    source = f'#!/bin/bash\necho "{greeting}"\necho $(( {a} * {b} ))\n'
    return task(
        f"Make {script} executable, then run it as ./{script} and save its output to {out}.",
        files={script: source},
        solution=[f"chmod +x {script}", f"./{script} > {out}"],
        checks=Checks(files={script: source, out: f"{greeting}\n{a * b}\n"}, executable=[script]),
    )


@family
def change_case(rng: random.Random) -> TerminalSpec:
    name, lines = text_file(rng)
    out = rng.choice(RESULT_FILES)
    if rng.random() < 0.5:
        case, command, expected = "upper", "tr a-z A-Z", [line.upper() for line in lines]
    else:
        lines = [" ".join(rng.choice((w, w.upper(), w.capitalize())) for w in line.split()) for line in lines]
        case, command, expected = "lower", "tr A-Z a-z", [line.lower() for line in lines]
    return task(
        f"Write the contents of {name} converted to {case} case to {out}.",
        files={name: joined(lines)},
        solution=[f"{command} < {name} > {out}"],
        checks=Checks(files={out: joined(expected)}),
    )


@family
def count_words(rng: random.Random) -> TerminalSpec:
    name, lines = text_file(rng, (3, 12))
    out = rng.choice(RESULT_FILES)
    return task(
        f"Write the total number of words in {name} to {out} (just the number).",
        files={name: joined(lines)},
        solution=[f"wc -w < {name} > {out}"],
        checks=Checks(files={out: f"{sum(len(line.split()) for line in lines)}\n"}),
    )


@family
def delete_matching_lines(rng: random.Random) -> TerminalSpec:
    word, lines, has_word = lines_with_word(rng)
    name = f"{rng.choice(WORDS)}.txt"
    return task(
        f"Delete every line that contains the word {word} from {name} (edit the file in place).",
        files={name: joined(lines)},
        solution=[f"sed -i '/{word}/d' {name}"],
        checks=Checks(files={name: joined(line for line, drop in zip(lines, has_word) if not drop)}),
    )


@family
def line_range(rng: random.Random) -> TerminalSpec:
    name, lines = text_file(rng, (10, 30))
    first = rng.randint(2, len(lines) - 3)
    last = rng.randint(first + 1, len(lines) - 1)
    out = rng.choice(RESULT_FILES)
    return task(
        f"Write lines {first} to {last} (inclusive) of {name} to {out}.",
        files={name: joined(lines)},
        solution=[f"sed -n '{first},{last}p' {name} > {out}"],
        checks=Checks(files={out: joined(lines[first - 1 : last])}),
    )
