"""Long-horizon pointer chasing through a key-value store: 'Follow "next" from "alice" to the record with a "value"'.

Each task hides a store of records keyed by name. The chain start -> ... -> end has `hops` keys: every record on it
holds the next key under "next", the last one holds the answer under "value" (a city or an animal: one of 22 words,
but it scores only once its record was read, so a guess pays nothing). The `get(key)` tool returns the record of a
key the question or a fetched record named (any other key is an error, so keys cannot be guessed either), so a
successful episode is `hops` calls, each copying a key out of the previous observation, then the value: hops + 1
turns. What makes it long-horizon:

- Distractor keys nearby: every record also holds `distractors` other link fields ("prev", "alt", "ref"; field
  order shuffled per record): "prev" of a chain record is the previous chain key, the others point at decoy
  records or back at the start, so each hop must copy the right field, not just any name.
- Decoy records: `decoys` off-chain records (half of them, by draw, terminal with a wrong value; the others
  pointing "next" at another decoy or at the start). A wrong hop lands on a real record, not an error: the episode
  walks back and forth, wanders through decoys or restarts until the turn budget (a long failure), or ends on a
  decoy's value (a wrong answer). No link skips ahead on the chain, so every success takes every hop, in order; a
  policy that answers before reaching the value fails short, so failures range from one turn to the whole budget
  (hops + 1 + extra_turns).
- `min_hops` < `hops` draws each task's chain length uniformly in [min_hops, hops]: successes then differ in length
  too (the aggregation ablations weigh long episodes differently).

The scripted expert reads each observation like the policy must (not the hidden store): start at the prompt's key,
follow "next", answer the "value". Families (`family`): the chain length, "hops_<n>". The expert's systematic
mistake (env.expert_error): it answers one hop short, with the last key instead of fetching its record (a key is
never a value: the episode fails).
"""

from __future__ import annotations

import json
import random
from typing import Any

from ipa_jax.envs.base import Env, Task, ToolError
from ipa_jax.envs.lookup import CITIES, NAMES, PETS
from ipa_jax.envs.tool_calls import ToolCall

DISTRACTOR_FIELDS = ("prev", "alt", "ref")
VALUES = CITIES + PETS  # single words like the keys: every copy in an episode is of the same kind

GET_TOOL = {
    "type": "function",
    "function": {
        "name": "get",
        "description": "Get the record stored under a key.",
        "parameters": {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]},
    },
}


class KVChainEnv(Env):
    """Pointer chasing. `hops` = calls a success needs (chain length; drawn in [min_hops, hops] when min_hops > 0),
    `distractors` = extra link fields per record, `decoys` = off-chain records, `extra_turns` = slack turns."""

    name = "kv_chain"

    def __init__(
        self,
        hops: int = 6,
        min_hops: int = 0,
        distractors: int = 1,
        decoys: int = 4,
        shuffle_fields: bool = True,
        extra_turns: int = 2,
    ):
        super().__init__()
        if hops < 1:
            raise ValueError(f"hops must be >= 1, got {hops}")
        if not 0 <= min_hops <= hops:
            raise ValueError(f"min_hops must be in [0, hops={hops}] (0 = hops), got {min_hops}")
        if not 0 <= distractors <= len(DISTRACTOR_FIELDS):
            raise ValueError(f"distractors must be in [0, {len(DISTRACTOR_FIELDS)}], got {distractors}")
        if decoys < 0:
            raise ValueError(f"decoys must be >= 0, got {decoys}")
        if decoys >= len(VALUES):  # every decoy's value differs from the answer
            raise ValueError(f"decoys must be < {len(VALUES)} (the value pool), got {decoys}")
        if hops + decoys > len(NAMES):
            raise ValueError(f"hops + decoys must be <= {len(NAMES)} (the key pool), got {hops + decoys}")
        if distractors and decoys < 2:  # a decoy's distractor needs a key besides itself and its next
            raise ValueError(
                f"distractors point at decoy records (or back at the start): need decoys >= 2, got {decoys}"
            )
        if extra_turns < 0:
            raise ValueError(f"extra_turns must be >= 0, got {extra_turns}")
        self.hops, self.min_hops, self.distractors, self.decoys = hops, min_hops or hops, distractors, decoys
        self.shuffle_fields, self.extra_turns = shuffle_fields, extra_turns
        self.known: set[str] = set()  # keys the episode was given: the start, then every key a fetched record names
        self.fetched: set[str] = set()

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [GET_TOOL]

    def max_turns_for(self, data: dict[str, Any]) -> int:
        # One call per chain key, the answer, and slack for a detour.
        return len(data["path"]) + 1 + self.extra_turns

    def _sample(self, rng: random.Random) -> tuple[str, str, dict[str, Any]]:
        hops = rng.randint(self.min_hops, self.hops)
        keys = rng.sample(NAMES, hops + self.decoys)
        path, decoys = keys[:hops], keys[hops:]
        answer, *wrong = rng.sample(VALUES, len(decoys) + 1)
        store: dict[str, dict[str, str]] = {}
        for i, key in enumerate(path):
            store[key] = {"next": path[i + 1]} if i + 1 < hops else {"value": answer}
        # Links other than the chain's own lead to decoys or back to the start: chain key i > 0 is reachable only from
        # key i - 1 ("next") or i + 1 ("prev"), so a success visits the whole chain, in order (no shortcut).
        off_chain = [*decoys, path[0]]
        for key, wrong_value in zip(decoys, wrong):  # a decoy's value is never the answer
            store[key] = (
                {"value": wrong_value}
                if rng.random() < 0.5
                else {"next": rng.choice([k for k in off_chain if k != key])}
            )
        for key in keys:
            record = store[key]
            # Distractors never point at the record itself nor at its true next key; on the chain "prev" is the
            # previous key, so confusing it with "next" walks back and forth.
            others = [k for k in off_chain if k != key and k != record.get("next")]
            record.update({f: rng.choice(others) for f in DISTRACTOR_FIELDS[: self.distractors]})
            if self.distractors and key in path[1:]:
                record["prev"] = path[path.index(key) - 1]
            items = list(record.items())
            if self.shuffle_fields:
                rng.shuffle(items)
            store[key] = dict(items)
        # The store's insertion order would reveal the chain: key order is shuffled too.
        order = list(store)
        rng.shuffle(order)
        store = {k: store[k] for k in order}
        prompt = f'Follow "next" from "{path[0]}" to the record with a "value". Answer the value.'
        return prompt, answer, {"store": store, "path": path}

    def reset(self, task: Task) -> str:
        prompt = super().reset(task)
        self.known, self.fetched = {task.data["path"][0]}, set()
        return prompt

    def _execute(self, call: ToolCall) -> str:
        assert self.task is not None
        key = call.arguments["key"].strip().lower()
        # Only keys given so far can be fetched: guessing a key (1 in 26 is the chain's end) would skip hops. An absent
        # key gets the same error, so errors do not reveal the store.
        if key not in self.known:
            raise ToolError(f"unknown key '{key[:20]}'")
        record = self.task.data["store"][key]
        self.fetched.add(key)
        self.known.update(v for f, v in record.items() if f != "value")
        return json.dumps(record)

    def final_answer(self, text: str) -> float:
        """1 for the chain's value once its record was read in this episode; a value answered unread is a guess (1 in
        22) and scores 0."""
        reward = super().final_answer(text)
        return reward if self.task.data["path"][-1] in self.fetched else 0.0

    def family(self, task) -> str:
        return f"hops_{len(task.data['path'])}"

    def expert_mistake(self, task, observations: list[str], action: ToolCall | str) -> ToolCall | str | None:
        last = isinstance(action, ToolCall) and action.arguments["key"] == task.data["path"][-1]
        return action.arguments["key"] if last else None

    def expert_action(self, task, observations: list[str]) -> ToolCall | str:
        if not observations:
            return ToolCall("get", {"key": task.data["path"][0]})
        record = json.loads(observations[-1])
        return record["value"] if "value" in record else ToolCall("get", {"key": record["next"]})
