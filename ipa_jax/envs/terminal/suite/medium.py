"""Medium terminal tasks: small scripts and pipelines (write a shell or Python script that computes something from an
input file, fix a small broken script, aggregate a CSV, extract JSON fields, filter and count log lines).

Scripts the agent writes are also tried on a second input it never sees (/tests/inputs), so a hardcoded answer
fails.
"""

from __future__ import annotations

import json
import random

from ipa_jax.envs.terminal.spec import TerminalSpec
from ipa_jax.envs.terminal.suite._common import (
    CITIES,
    INPUTS_DIR,
    NAMES,
    RESULT_FILES,
    SERVICES,
    WORDS,
    Checks,
    Maker,
    Run,
    family_decorator,
    joined,
    lines_with_word,
    phrase,
    shown,
    task,
)

TIER = "medium"
FAMILIES: list[Maker] = []
family = family_decorator(TIER, FAMILIES)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
SETTING_KEYS = ("host", "port", "user", "timeout", "retries", "mode", "region", "level", "owner", "theme", "language")


def write_file_step(path: str, text: str) -> str:
    """A solution step writing `text` to `path` with a quoted heredoc (no expansion inside)."""
    return f"cat > {path} <<'EOF'\n{text}EOF"


def integers(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randint(low, high) for _ in range(rng.randint(5, 12))]


def clock(rng: random.Random, n: int) -> list[str]:
    """`n` increasing HH:MM:SS times of one day."""
    return [f"{s // 3600:02d}:{s // 60 % 60:02d}:{s % 60:02d}" for s in sorted(rng.sample(range(86400), n))]


@family
def column_sum_script(rng: random.Random) -> TerminalSpec:
    n_columns = rng.randint(2, 4)
    column = rng.randint(2, n_columns + 1)

    def table() -> list[list[str]]:
        return [
            [rng.choice(WORDS), *(str(rng.randint(0, 99)) for _ in range(n_columns))] for _ in range(rng.randint(4, 9))
        ]

    def column_total(rows: list[list[str]]) -> str:
        return f"{sum(int(row[column - 1]) for row in rows)}\n"

    visible, hidden = table(), table()
    script, data, out = (
        rng.choice(("sum.sh", "total.sh", "colsum.sh")),
        rng.choice(("table.txt", "scores.txt")),
        rng.choice(RESULT_FILES),
    )
    return task(
        f"Write a bash script {script}: `bash {script} FILE` prints the sum of column {column} of FILE "
        f"(space-separated). Run it on {data} and save the output to {out}.",
        files={data: joined(" ".join(row) for row in visible)},
        solution=[
            write_file_step(script, f"#!/bin/bash\nawk '{{s += ${column}}} END {{print s}}' \"$1\"\n"),
            f"bash {script} {data} > {out}",
        ],
        checks=Checks(
            files={out: column_total(visible)},
            inputs={"table.txt": joined(map(" ".join, hidden))},
            runs=[Run(f"bash {script} {INPUTS_DIR}/table.txt", column_total(hidden))],
        ),
    )


@family
def number_stats_script(rng: random.Random) -> TerminalSpec:
    statistics = {
        "largest": ("max(values)", max),
        "smallest": ("min(values)", min),
        "mean": ('f"{sum(values) / len(values):.2f}"', lambda v: f"{sum(v) / len(v):.2f}"),
    }
    stat = rng.choice(sorted(statistics))
    expression, compute = statistics[stat]
    rounding = " rounded to 2 decimals (like 3.50)" if stat == "mean" else ""
    visible, hidden = integers(rng, -50, 200), integers(rng, -50, 200)
    script = rng.choice(("stats.py", "calc.py", "summary.py", "measure.py"))
    data, out = rng.choice(("values.txt", "data.txt", "readings.txt")), rng.choice(RESULT_FILES)
    source = f"import sys\n\nvalues = [int(line) for line in open(sys.argv[1]) if line.strip()]\nprint({expression})\n"
    return task(
        f"Write a Python script {script}: `python3 {script} FILE` prints the {stat} of the integers in FILE "
        f"(one per line){rounding}. Run it on {data} and save the output to {out}.",
        files={data: joined(map(str, visible))},
        solution=[write_file_step(script, source), f"python3 {script} {data} > {out}"],
        checks=Checks(
            files={out: f"{compute(visible)}\n"},
            inputs={"values.txt": joined(map(str, hidden))},
            runs=[Run(f"python3 {script} {INPUTS_DIR}/values.txt", f"{compute(hidden)}\n")],
        ),
    )


@family
def fix_shell_script(rng: random.Random) -> TerminalSpec:
    word, lines, has_word = lines_with_word(rng)
    data, wrong_data = [f"{stem}.txt" for stem in rng.sample(WORDS, 2)]
    script, out = rng.choice(("report.sh", "summary.sh", "status.sh")), rng.choice(RESULT_FILES)
    label = rng.choice(NAMES)
    working = (
        f'#!/bin/bash\nfile={data}\ntotal=$(wc -l < "$file")\nmatches=$(grep -c {word} "$file")\n'
        f'echo "{label}: $matches of $total lines"\n'
    )
    bugs = {  # broken script -> the fix
        "typo": (working.replace("echo ", "ech "), f"sed -i 's/^ech /echo /' {script}"),
        "wrong file": (
            working.replace(f"file={data}", f"file={wrong_data}"),
            f"sed -i 's/^file=.*/file={data}/' {script}",
        ),
        "open quote": (working.replace('lines"\n', "lines\n"), f"sed -i 's/ lines$/ lines\"/' {script}"),
    }
    broken, fix = bugs[rng.choice(sorted(bugs))]
    expected = f"{label}: {sum(has_word)} of {len(lines)} lines\n"
    return task(
        f"{script} should print how many lines of {data} contain {word}, but it is broken. Fix it, then "
        f"save the output of `bash {script}` to {out}.",
        files={script: broken, data: joined(lines)},
        solution=[shown(f"bash {script}"), fix, f"bash {script} > {out}"],
        checks=Checks(files={out: expected, data: joined(lines)}, runs=[Run(f"bash {script}", expected)]),
    )


@family
def csv_group_sum(rng: random.Random) -> TerminalSpec:
    key, pool = rng.choice((("city", CITIES), ("team", WORDS), ("customer", NAMES)))
    groups = rng.sample(pool, rng.randint(2, 4))
    header = rng.sample(["id", key, "item", "amount"], 4)
    totals: dict[str, int] = {}
    rows = []
    for row_id in range(1, rng.randint(6, 12) + 1):
        row = {"id": str(row_id), key: rng.choice(groups), "item": rng.choice(WORDS), "amount": rng.randint(1, 500)}
        totals[row[key]] = totals.get(row[key], 0) + row["amount"]
        rows.append(",".join(str(row[col]) for col in header))
    data, out = rng.choice(("sales.csv", "orders.csv", "payments.csv")), rng.choice(("totals.csv", "summary.csv"))
    key_col, amount_col = header.index(key) + 1, header.index("amount") + 1
    return task(
        f"{data} is comma-separated with a header. Write the total amount per {key} to {out} as "
        f"`{key},total` lines sorted by {key}, without a header.",
        files={data: joined([",".join(header), *rows])},
        solution=[
            f"head -3 {data}",
            f"awk -F, 'NR > 1 {{t[${key_col}] += ${amount_col}}} "
            f'END {{for (k in t) print k "," t[k]}}\' {data} | sort > {out}',
        ],
        checks=Checks(files={out: joined(f"{group},{totals[group]}" for group in sorted(totals))}),
    )


@family
def json_field_filter(rng: random.Random) -> TerminalSpec:
    field = rng.choice(("price", "stock", "weight"))
    items = [
        {"name": name, "price": rng.randint(1, 100), "stock": rng.randint(0, 50), "weight": rng.randint(1, 20)}
        for name in rng.sample(WORDS, rng.randint(5, 9))
    ]
    values = sorted({item[field] for item in items})
    if len(values) < 2:  # every item has the same value: make the first one larger
        items[0][field] += 1
        values = sorted({item[field] for item in items})
    threshold = rng.choice(values[:-1])  # at least one item above it and one not
    data, out = rng.choice(("items.json", "products.json", "inventory.json")), rng.choice(RESULT_FILES)
    program = (
        f'import json\n\nfor item in json.load(open("{data}")):\n    if item["{field}"] > {threshold}:\n'
        f'        print(item["name"])\n'
    )
    return task(
        f"{data} holds a JSON list of objects. Write the name of every object whose {field} is greater than "
        f"{threshold} to {out}, one per line, in file order.",
        files={data: json.dumps(items, indent=1) + "\n"},
        solution=[f"head -c 200 {data}", f"python3 - > {out} <<'EOF'\n{program}EOF"],
        checks=Checks(files={out: joined(item["name"] for item in items if item[field] > threshold)}),
    )


@family
def log_level_counts(rng: random.Random) -> TerminalSpec:
    levels = [rng.choice(LOG_LEVELS) for _ in range(rng.randint(6, 16))]
    date = f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    lines = [f"{date} {time} {level} {phrase(rng, 3)}" for time, level in zip(clock(rng, len(levels)), levels)]
    data, out = rng.choice(("app.log", "server.log", "events.log")), rng.choice(("counts.txt", "levels.txt"))
    return task(
        f"Count the lines of {data} per log level (the third field). Write `LEVEL COUNT` lines, sorted by "
        f"level, to {out}.",
        files={data: joined(lines)},
        solution=[f"head -3 {data}", f"awk '{{print $3}}' {data} | sort | uniq -c | awk '{{print $2, $1}}' > {out}"],
        checks=Checks(files={out: joined(f"{level} {levels.count(level)}" for level in sorted(set(levels)))}),
    )


@family
def log_service_errors(rng: random.Random) -> TerminalSpec:
    service, *other_services = rng.sample(SERVICES, rng.randint(3, 4))
    entries = [(rng.choice(other_services), rng.choice(LOG_LEVELS)) for _ in range(rng.randint(4, 8))]
    entries += [(service, "ERROR")] * rng.randint(1, 3) + [(service, rng.choice(LOG_LEVELS[:3]))] * rng.randint(1, 3)
    rng.shuffle(entries)
    lines = [
        (time, svc, level, phrase(rng, rng.randint(2, 4)))
        for time, (svc, level) in zip(clock(rng, len(entries)), entries)
    ]
    data, out = rng.choice(("services.log", "system.log", "cluster.log")), rng.choice(("errors.txt", "failures.txt"))
    return task(
        f"Write the message (the text after the level) of every ERROR line of service {service} in {data} "
        f"to {out}, one per line, in file order.",
        files={data: joined(" ".join(line) for line in lines)},
        solution=[f"grep ' {service} ERROR ' {data}", f"grep ' {service} ERROR ' {data} | cut -d' ' -f4- > {out}"],
        checks=Checks(files={out: joined(msg for _, svc, level, msg in lines if svc == service and level == "ERROR")}),
    )


@family
def top_words(rng: random.Random) -> TerminalSpec:
    top = rng.randint(2, 4)
    words = rng.sample(WORDS, top + rng.randint(1, 3))
    counts = rng.sample(range(1, 10), len(words))  # distinct: the ranking has no ties
    tokens = [word for word, count in zip(words, counts) for _ in range(count)]
    rng.shuffle(tokens)
    lines, start = [], 0
    while start < len(tokens):
        width = rng.randint(3, 7)
        lines.append(" ".join(tokens[start : start + width]))
        start += width
    ranked = sorted(zip(counts, words), reverse=True)[:top]
    data, out = rng.choice(("text.txt", "story.txt", "notes.txt")), rng.choice(("top.txt", "frequent.txt"))
    return task(
        f"Write the {top} most frequent words of {data} to {out} as `word count` lines, most frequent first.",
        files={data: joined(lines)},
        solution=[
            f"head -3 {data}",
            f"tr -s ' ' '\\n' < {data} | sort | uniq -c | sort -rn | head -n {top} | awk '{{print $2, $1}}' > {out}",
        ],
        checks=Checks(files={out: joined(f"{word} {count}" for count, word in ranked)}),
    )


@family
def batch_rename(rng: random.Random) -> TerminalSpec:
    old, new, decoy = rng.sample(WORDS, 3)
    old_ext, new_ext = rng.sample(("jpeg", "jpg", "txt", "text", "dat", "bak"), 2)
    numbers = rng.sample(range(1, 100), rng.randint(3, 6))
    contents = {n: phrase(rng, 2) + "\n" for n in numbers}
    decoy_name = f"{decoy}_{rng.randint(1, 99)}.{old_ext}"
    decoy_text = phrase(rng, 2) + "\n"
    return task(
        f"Rename every file named {old}_N.{old_ext} (N a number) to {new}_N.{new_ext}, keeping N. Leave "
        f"other files alone.",
        files={**{f"{old}_{n}.{old_ext}": text for n, text in contents.items()}, decoy_name: decoy_text},
        solution=[
            "ls",
            f'for f in {old}_*.{old_ext}; do n=${{f#{old}_}}; mv "$f" "{new}_${{n%.{old_ext}}}.{new_ext}"; done',
        ],
        checks=Checks(
            files={**{f"{new}_{n}.{new_ext}": text for n, text in contents.items()}, decoy_name: decoy_text},
            absent=[f"{old}_{n}.{old_ext}" for n in numbers],
        ),
    )


@family
def key_value_script(rng: random.Random) -> TerminalSpec:
    keys = rng.sample(SETTING_KEYS, rng.randint(4, 7))
    values = {key: rng.choice((rng.choice(WORDS), str(rng.randint(1, 9999)))) for key in keys}
    config = rng.choice(("settings.conf", "app.env", "config.ini"))
    script, out = rng.choice(("getval.sh", "lookup.sh", "setting.sh")), rng.choice(RESULT_FILES)
    asked, *tried = rng.sample(keys, 3)
    config_text = joined(f"{key}={value}" for key, value in values.items())
    return task(
        f"Write a bash script {script}: `bash {script} KEY` prints the value of KEY from {config} (lines "
        f"KEY=VALUE). Use it to save the value of {asked} to {out}.",
        files={config: config_text},
        solution=[
            write_file_step(script, f'#!/bin/bash\ngrep "^$1=" {config} | cut -d= -f2-\n'),
            f"bash {script} {asked} > {out}",
        ],
        checks=Checks(
            files={out: values[asked] + "\n", config: config_text},
            runs=[Run(f"bash {script} {key}", values[key] + "\n") for key in tried],
        ),
    )


@family
def csv_filter_rows(rng: random.Random) -> TerminalSpec:
    header = rng.sample(["name", "age", "city", "score"], 4)
    column = rng.choice(("age", "score"))
    rows = [
        {"name": name, "age": rng.randint(18, 80), "city": rng.choice(CITIES), "score": rng.randint(0, 100)}
        for name in rng.sample(NAMES, rng.randint(5, 10))
    ]
    values = sorted({row[column] for row in rows})
    if len(values) < 2:  # every row has the same value: make the first one larger
        rows[0][column] += 1
        values = sorted({row[column] for row in rows})
    threshold = rng.choice(values[1:])  # at least one row below it and one not

    def csv_line(row: dict) -> str:
        return ",".join(str(row[col]) for col in header)

    data, out = rng.choice(("people.csv", "members.csv", "players.csv")), rng.choice(("selected.csv", "filtered.csv"))
    return task(
        f"Write the header line and every row of {data} whose {column} is at least {threshold} to {out}, "
        f"in file order.",
        files={data: joined([",".join(header), *map(csv_line, rows)])},
        solution=[f"head -2 {data}", f"awk -F, 'NR == 1 || ${header.index(column) + 1} >= {threshold}' {data} > {out}"],
        checks=Checks(
            files={out: joined([",".join(header), *(csv_line(row) for row in rows if row[column] >= threshold)])}
        ),
    )


@family
def dedupe_script(rng: random.Random) -> TerminalSpec:
    def with_repeats() -> list[str]:
        distinct = rng.sample(WORDS, rng.randint(3, 6))
        return distinct + [rng.choice(distinct) for _ in range(rng.randint(2, 6))]

    def shuffled(lines: list[str]) -> list[str]:
        return rng.sample(lines, len(lines))

    def first_occurrences(lines: list[str]) -> str:
        return joined(dict.fromkeys(lines))

    visible, hidden = shuffled(with_repeats()), shuffled(with_repeats())
    script, out = rng.choice(("dedupe.py", "unique.py", "firsts.py")), rng.choice(RESULT_FILES)
    data = rng.choice(("visits.txt", "list.txt", "queue.txt"))
    source = (
        "import sys\n\nseen = set()\nfor line in open(sys.argv[1]):\n    if line not in seen:\n"
        '        seen.add(line)\n        print(line, end="")\n'
    )
    return task(
        f"Write a Python script {script}: `python3 {script} FILE` prints the lines of FILE without repeats, "
        f"keeping the first occurrence of each, in order. Run it on {data} and save the output to {out}.",
        files={data: joined(visible)},
        solution=[write_file_step(script, source), f"python3 {script} {data} > {out}"],
        checks=Checks(
            files={out: first_occurrences(visible)},
            inputs={"list.txt": joined(hidden)},
            runs=[Run(f"python3 {script} {INPUTS_DIR}/list.txt", first_occurrences(hidden))],
        ),
    )


@family
def join_by_id(rng: random.Random) -> TerminalSpec:
    ids = rng.sample(range(100, 1000), rng.randint(5, 8))
    names = dict(zip(ids, rng.sample(NAMES, len(ids))))
    scores = {i: rng.randint(0, 100) for i in ids}
    del names[ids[0]], scores[ids[1]]  # one id only has a score, one only a name
    names_file, scores_file = rng.choice((("names.txt", "scores.txt"), ("people.txt", "points.txt")))
    out = rng.choice(("joined.txt", "combined.txt"))
    both = sorted((names[i], scores[i]) for i in ids[2:])
    return task(
        f"{names_file} has `id name` lines and {scores_file} has `id score` lines. For every id in both "
        f"files write `name score` to {out}, sorted by name.",
        files={
            names_file: joined(f"{i} {names[i]}" for i in rng.sample(sorted(names), len(names))),
            scores_file: joined(f"{i} {scores[i]}" for i in rng.sample(sorted(scores), len(scores))),
        },
        solution=[
            f"head -3 {names_file} {scores_file}",
            f"awk 'NR == FNR {{name[$1] = $2; next}} $1 in name {{print name[$1], $2}}' {names_file} "
            f"{scores_file} | sort > {out}",
        ],
        checks=Checks(files={out: joined(f"{name} {score}" for name, score in both)}),
    )


@family
def fix_python_script(rng: random.Random) -> TerminalSpec:
    numbers = integers(rng, 1, 500)
    data, wrong_data = f"{rng.choice(('numbers', 'values', 'amounts'))}.txt", f"{rng.choice(WORDS)}.txt"
    script, out = rng.choice(("total.py", "add.py", "sum_up.py")), rng.choice(RESULT_FILES)
    label = rng.choice(NAMES)
    working = (
        f'total = 0\nwith open("{data}") as f:\n    for line in f:\n        total += int(line)\n'
        f'print("{label}:", total)\n'
    )
    bugs = {  # broken script -> the fix
        "str + int": (working.replace("int(line)", "line"), f"sed -i 's/total += line/total += int(line)/' {script}"),
        "misspelt name": (working.replace(", total)", ", totl)"), f"sed -i 's/totl)/total)/' {script}"),
        "wrong file": (working.replace(data, wrong_data), f"sed -i 's/{wrong_data}/{data}/' {script}"),
    }
    broken, fix = bugs[rng.choice(sorted(bugs))]
    expected = f"{label}: {sum(numbers)}\n"
    return task(
        f"{script} should print the sum of the numbers in {data}, but it crashes. Fix it, then save the "
        f"output of `python3 {script}` to {out}.",
        files={script: broken, data: joined(map(str, numbers))},
        solution=[shown(f"python3 {script}"), fix, f"python3 {script} > {out}"],
        checks=Checks(
            files={out: expected, data: joined(map(str, numbers))}, runs=[Run(f"python3 {script}", expected)]
        ),
    )
