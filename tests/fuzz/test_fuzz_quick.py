"""Quick fuzz of the pure ingest path (RELIABILITY.md, probe 7): >= 10^4 generated inputs —
random bytes, truncations, bit flips, wrong shapes and types, huge and negative numbers, deep
nesting, invalid UTF-8 (known and unknown keys), future/NaN/negative timestamps, wrong versions
and headers, unknown tags, oversize messages, state and cap abuse — interleaved with envelopes of
four well-behaved nodes, through `Ingest.handle` on a real `Index` (`kvpipe.bench.fuzz`).

The long form is `kvpipe bench fuzz --json` (10^5 inputs)."""
from __future__ import annotations

import pytest

from kvpipe.bench.fuzz import run_fuzz
from kvpipe.schemas.codec import ERROR_KINDS


@pytest.mark.parametrize("seed", [1, 2])
def test_hostile_inputs_never_crash_are_classified_and_leave_good_nodes_exact(seed):
    report = run_fuzz(12_000, seed=seed)
    assert report.inputs == 12_000 and report.hostile > 6_000 and report.good > 4_000
    assert report.crashes == 0, report.crash_examples
    assert report.misclassified == [], report.misclassified
    assert set(report.dlq_by_reason) <= set(ERROR_KINDS) and "internal" not in report.dlq_by_reason
    # every reason a human can act on shows up, so the generators really reach each branch
    assert set(report.dlq_by_reason) == set(ERROR_KINDS), report.dlq_by_reason
    assert report.model_mismatches == [], report.model_mismatches
    c = report.index_counters
    assert c["clock_clamped"] > 0 and c["capped_stores"] > 0 and c["refused_envelopes"] > 0 and c["resyncs"] > 0


def test_without_hostile_input_every_good_envelope_applies():
    report = run_fuzz(2_000, seed=3, hostile_share=0.0)
    assert report.outcomes == {"applied": 2_000} and report.model_mismatches == []
