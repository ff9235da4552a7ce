"""One episode as HTML: tokens coloured by kind (prompt and observations, sampled chunks, expert targets)."""

from __future__ import annotations

import html
import os
from dataclasses import dataclass

import numpy as np

from ipa_jax.chat import load_tokenizer
from ipa_jax.pipeline import RunFolder
from ipa_jax.trajectory import Trajectory

# Chunk colours (light, so the text stays readable); chunk k takes _PALETTE[k % len].
_PALETTE = ("#cfe8ff", "#ffe0b3", "#d4f7d4", "#f7d4f0", "#fff5b3", "#d9d4f7", "#c8f0ee", "#ffd1d1")
_GREY = "#e6e6e6"


@dataclass(frozen=True)
class Segment:
    """A maximal run [start, end) of tokens of one kind: "context" (prompt and tool observations), "action"
    (sampled by the policy, chunk `chunk_id`) or "expert" (prefilled imitation targets)."""

    start: int
    end: int
    kind: str
    chunk_id: int


def episode_segments(traj: Trajectory) -> list[Segment]:
    """Splits a trajectory into Segments; segment boundaries fall wherever kind or chunk id changes."""
    kinds = np.where(traj.expert_mask, 2, np.where(traj.action_mask, 1, 0))
    chunks = np.where(traj.action_mask, traj.chunk_ids, -1)
    segments, start = [], 0
    for t in range(1, traj.length + 1):
        if t == traj.length or kinds[t] != kinds[start] or chunks[t] != chunks[start]:
            kind = ("context", "action", "expert")[int(kinds[start])]
            segments.append(Segment(start, t, kind, int(chunks[start])))
            start = t
    return segments


def render_episode_html(traj: Trajectory, tokenizer, title: str | None = None, collapse_prompt: bool = True) -> str:
    """One episode as HTML: action tokens on a background colour per chunk id (hover: chunk, positions),
    context (prompt, tool observations) grey, expert tokens gold and underlined; the prompt (the context before
    the first generated or expert token: system turn, tool specs, question) folded into a <details> element when
    `collapse_prompt`. Each segment is decoded as a whole, so multi-byte characters split across tokens render."""
    info = traj.info
    head = title or traj.uid
    facts = [f"reward {traj.reward:g}", f"{traj.num_chunks} chunks", f"{int(traj.action_mask.sum())} action tokens"]
    facts += [f"{k} {info[k]}" for k in ("split", "finish_reason", "num_tool_calls", "num_tool_errors") if k in info]
    parts = [
        '<div style="font-family:monospace;font-size:12px;margin:8px 0">',
        f"<div><b>{html.escape(str(head))}</b> &middot; {html.escape(' · '.join(map(str, facts)))}</div>",
        '<div style="white-space:pre-wrap;border:1px solid #ccc;padding:4px">',
    ]
    for seg in episode_segments(traj):
        text = html.escape(tokenizer.decode(traj.tokens[seg.start : seg.end].tolist(), skip_special_tokens=False))
        where = f"tokens {seg.start}-{seg.end - 1}"
        if seg.kind == "action":
            style = f"background:{_PALETTE[seg.chunk_id % len(_PALETTE)]}"
            label = f"chunk {seg.chunk_id}, {where}"
        elif seg.kind == "expert":
            style = "background:#ffd54f;text-decoration:underline"
            label = f"expert, {where}"
        else:
            style = f"background:{_GREY};color:#555"
            label = f"context, {where}"
        span = f'<span class="{seg.kind}" data-chunk="{seg.chunk_id}" style="{style}" title="{label}">{text}</span>'
        if collapse_prompt and seg.start == 0 and seg.kind == "context":
            span = f"<details><summary>prompt ({seg.end} tokens)</summary>{span}</details>"
        parts.append(span)
    parts.append("</div></div>")
    return "".join(parts)


def load_run_tokenizer(run_dir: str):
    """The tokenizer the run used: <run_dir>/tokenizer, else the config's model.tokenizer or model.path."""
    folder = RunFolder(run_dir)
    candidates = [folder.tokenizer_dir]
    if folder.has_config():
        model = folder.read_config().get("model", {})
        candidates += [p for p in (model.get("tokenizer"), model.get("path")) if p]
    for path in candidates:
        if os.path.isdir(path):
            return load_tokenizer(path)
    raise FileNotFoundError(f"{run_dir}: no tokenizer found (looked in {candidates})")
