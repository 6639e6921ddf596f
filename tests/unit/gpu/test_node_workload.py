"""The node's workload: seeded and deterministic, Zipf-popular system prompts, conversations whose
next prompt extends the previous one, exact repeats, and the JSONL trace format."""
from __future__ import annotations

import json
from collections import Counter

import pytest

from kvpipe.gpu.node.workload import SyntheticConfig, SyntheticWorkload, TraceWorkload, output_tokens


def drive(workload: SyntheticWorkload, steps: int, finish_after: int = 3) -> list:
    """Arrivals over `steps`, each request 'finishing' `finish_after` steps after it arrived."""
    seen, due = [], {}
    for step in range(steps):
        for spec in due.pop(step, []):
            workload.on_finished(spec, step)
        for spec in workload.arrivals(step):
            seen.append(spec)
            due.setdefault(step + finish_after, []).append(spec)
    return seen


def test_same_seed_same_requests_other_seed_other_traffic_same_system_prompts() -> None:
    a = drive(SyntheticWorkload(SyntheticConfig(seed=7)), 200)
    b = drive(SyntheticWorkload(SyntheticConfig(seed=7)), 200)
    c_wl = SyntheticWorkload(SyntheticConfig(seed=8))
    c = drive(c_wl, 200)
    key = lambda specs: [(s.request_id, s.arrival_step, s.prompt_token_ids, s.output_token_ids) for s in specs]
    assert key(a) == key(b)
    assert key(a) != key(c)
    assert c_wl.system_prompts == SyntheticWorkload(SyntheticConfig(seed=7)).system_prompts


def test_system_prompts_follow_zipf_popularity() -> None:
    specs = drive(SyntheticWorkload(SyntheticConfig(seed=1, arrivals_per_step=2.0, num_system_prompts=5)), 1500)
    first_turns = Counter(s.system_prompt for s in specs if s.turn == 0 and s.system_prompt is not None)
    counts = [first_turns[i] for i in range(5)]
    assert counts[0] > counts[1] > counts[4] > 0
    assert counts[0] / sum(counts) == pytest.approx(1 / sum(1 / (i + 1) ** 1.1 for i in range(5)), abs=0.06)


def test_next_turn_is_previous_prompt_plus_its_output_plus_new_user_tokens() -> None:
    wl = SyntheticWorkload(SyntheticConfig(seed=2, max_turns=4))
    specs = drive(wl, 400)
    by_id = {s.request_id: s for s in specs}
    follow_ups = [s for s in specs if s.turn > 0]
    assert follow_ups, "no multi-turn conversation in 400 steps"
    for s in follow_ups:
        prev = by_id[f"s2-c{s.conversation}t{s.turn - 1}"]
        head = prev.prompt_token_ids + prev.output_token_ids
        assert s.prompt_token_ids[: len(head)] == head
        assert len(s.prompt_token_ids) > len(head)
        assert s.arrival_step > prev.arrival_step + 3  # after the previous turn finished
        assert s.prompt_token_ids[: len(wl.system_prompts[s.system_prompt])] == wl.system_prompts[s.system_prompt]


def test_exact_repeats_reuse_an_earlier_prompt() -> None:
    specs = drive(SyntheticWorkload(SyntheticConfig(seed=4, repeat_prob=0.3)), 300)
    repeats = [s for s in specs if "-rep" in s.request_id]
    assert repeats
    earlier = {tuple(s.prompt_token_ids) for s in specs if "-rep" not in s.request_id}
    assert all(tuple(r.prompt_token_ids) in earlier for r in repeats)


def test_outputs_are_a_pure_function_of_the_request_id() -> None:
    assert output_tokens("r1", 8) == output_tokens("r1", 8)
    assert output_tokens("r1", 8) != output_tokens("r2", 8)
    assert output_tokens("r1", 4) == output_tokens("r1", 8)[:4]


def test_trace_file_arrivals_by_step_in_file_order(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    lines = [{"request_id": "a", "prompt_token_ids": [1, 2, 3], "max_tokens": 2, "arrival_step": 1},
             {"request_id": "b", "prompt_token_ids": [4], "arrival_step": 1, "output_token_ids": list(range(16))},
             {"request_id": "c", "prompt_token_ids": [5, 6]}]
    path.write_text("# comment\n" + "\n".join(json.dumps(x) for x in lines) + "\n\n")
    wl = TraceWorkload.from_file(path)
    assert [s.request_id for s in wl.arrivals(0)] == ["c"]
    step1 = wl.arrivals(1)
    assert [s.request_id for s in step1] == ["a", "b"]
    assert step1[0].output_token_ids == output_tokens("a", 2)
    assert step1[1].max_tokens == 16 and step1[1].output_token_ids == list(range(16))


@pytest.mark.parametrize("line, message", [
    ('{"prompt_token_ids": [1]}', "request_id"),
    ('{"request_id": "x", "prompt_token_ids": []}', "empty prompt"),
    ('{"request_id": "x", "prompt_token_ids": [1], "max_tokens": 0}', "max_tokens"),
])
def test_bad_trace_lines_name_the_line(tmp_path, line, message) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1") as exc:
        TraceWorkload.from_file(path)
    assert message in str(exc.value)
