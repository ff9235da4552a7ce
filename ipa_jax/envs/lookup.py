"""Multi-hop lookup over a hidden table of people: "What is the city of the friend of alice?".

Each task hides a small table of people; every record has two links to other people (friend, boss)
and two attributes (city, pet). A question follows `hops - 1` links from a start person, then asks an
attribute, so the policy needs exactly `hops` lookups and must copy a name out of each observation into
the next call; the other fields of each record are distractors (their order is shuffled per record). Records are JSON
and names are quoted in the question, so a name is the same token sequence wherever it appears.

Families (`family`): the attribute asked, "city" or "pet". The expert's systematic mistake (env.expert_error): it
answers one lookup short, with the name it should look up last (a name is never a city or a pet: the episode fails).
"""

from __future__ import annotations

import json
import random
from typing import Any

from ipa_jax.envs.base import Env, ToolError
from ipa_jax.envs.tool_calls import ToolCall

NAMES = (
    "alice bob carol dave erin frank grace heidi ivan judy karl lena mike nora oscar paul quinn rosa "
    "sam tina uma victor wendy xavier yara zack"
).split()
CITIES = "paris rome oslo lima cairo tokyo delhi quito dakar perth hanoi riga".split()
PETS = "cat dog owl fox bat eel yak ant bee cow".split()
LINKS = ("friend", "boss")
ATTRIBUTES = {"city": CITIES, "pet": PETS}

LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Get the record of a person.",
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    },
}


class LookupEnv(Env):
    """Multi-hop lookup. `hops` = number of lookups needed (>= 2); `num_people` = table size (distractors)."""

    name = "lookup"

    def __init__(self, hops: int = 2, num_people: int = 6, shuffle_fields: bool = True, extra_turns: int = 1):
        super().__init__()
        if hops < 1:
            raise ValueError(f"hops must be >= 1, got {hops}")
        if not 2 <= num_people <= len(NAMES):
            raise ValueError(f"num_people must be in [2, {len(NAMES)}], got {num_people}")
        if extra_turns < 0:
            raise ValueError(f"extra_turns must be >= 0, got {extra_turns}")
        self.hops = hops
        self.num_people = num_people
        self.shuffle_fields = shuffle_fields
        self.extra_turns = extra_turns

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [LOOKUP_TOOL]

    def max_turns_for(self, data: dict[str, Any]) -> int:
        # hops lookups + the answer, plus slack for recovering from a mistake.
        return len(data["path"]) + 1 + self.extra_turns

    def _sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        people = rng.sample(NAMES, self.num_people)
        table: dict[str, dict[str, str]] = {}
        for p in people:
            others = [q for q in people if q != p]
            record = {link: rng.choice(others) for link in LINKS}
            record.update({attr: rng.choice(values) for attr, values in ATTRIBUTES.items()})
            items = list(record.items())
            if self.shuffle_fields:
                rng.shuffle(items)
            table[p] = dict(items)
        links = [rng.choice(LINKS) for _ in range(self.hops - 1)]
        attribute = rng.choice(sorted(ATTRIBUTES))
        start = rng.choice(people)
        path = [start]  # the people looked up, in order
        for link in links:
            path.append(table[path[-1]][link])
        answer = table[path[-1]][attribute]
        # "the city of the friend of the boss of alice": innermost link is applied first.
        phrase = " of ".join([f"the {attribute}"] + [f"the {link}" for link in reversed(links)] + [f'"{start}"'])
        prompt = f"What is {phrase}?"
        return prompt, answer, {"table": table, "path": path, "links": links, "attribute": attribute}

    def _execute(self, call: ToolCall) -> str:
        assert self.task is not None
        table = self.task.data["table"]
        name = call.arguments["name"].strip().lower()
        if name not in table:
            raise ToolError(f"no person named '{name[:20]}'")
        return json.dumps(table[name])

    def family(self, task) -> str:
        return task.data["attribute"]

    def expert_mistake(self, task, observations: list[str], action: ToolCall | str) -> ToolCall | str | None:
        last = isinstance(action, ToolCall) and len(observations) == len(task.data["path"]) - 1
        return action.arguments["name"] if last else None

    def expert_action(self, task, observations: list[str]) -> ToolCall | str:
        path, attribute = task.data["path"], task.data["attribute"]
        # The expert reads each observation like the policy must (not the hidden table).
        fields = [json.loads(obs) for obs in observations]
        if not observations:
            return ToolCall("lookup", {"name": path[0]})
        if len(observations) < len(path):
            link = task.data["links"][len(observations) - 1]
            return ToolCall("lookup", {"name": fields[-1][link]})
        return fields[-1][attribute]
