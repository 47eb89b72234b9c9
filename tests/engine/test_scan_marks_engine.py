"""The schema closer's reader after a rollback (OutputPolicy._scan, OutputState.scan_marks):
a loop cut or a jump that replaces its sampled token reads on from the reader's last copy
before the rollback, not from the document's start; at every step its state is the state
of a reader fed the whole output from the start."""

import json

import pytest

from core.grammar_spec import GrammarSpec
from core.request import GenerationRequest
from tests.engine.test_budget_bound_engine import scripted
from worker.engine.sampling import SamplingParams
from worker.guided import output_policy
from worker.guided.json_closing import JsonScan
from worker.guided.output_policy import OutputPolicy

pytestmark = pytest.mark.integration

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"},
    "steps": {"type": "array", "minItems": 1, "items": {"type": "string"}},
    "serves": {"type": "integer"}, "note": {"type": "string", "minLength": 12}},
    "required": ["title", "steps", "serves", "note"]}


def state(scan: JsonScan) -> tuple:
    return (scan.tokens, scan.broken, scan.done, scan.in_free_string(),
            scan.completion(output_policy._LAYOUTS[0]))


@pytest.mark.parametrize("engine_name", ["xgrammar", "llguidance"])
def test_a_cut_rows_reader_reads_on_from_its_copy_as_a_fresh_read_would(
        make_tiny_engine, monkeypatch, engine_name):
    seen, restored = [], []
    plain_scan = OutputPolicy._scan

    def checked(self, seq):
        st = seq.guide.ending
        prior, marks = st.scan, [m.tokens for m in st.scan_marks]
        scan = plain_scan(self, seq)
        if scan is not None:
            if scan is not prior and marks:  # read again, from a copy
                restored.append(marks)
            fresh = JsonScan(scan.nodes)
            vocab = self.guided.closer.vocab
            for t in seq.output_ids[st.scan_from:]:
                fresh.feed_bytes(vocab[t])
            fresh.tokens = len(seq.output_ids) - st.scan_from
            seen.append((state(scan), state(fresh)))
        return scan
    monkeypatch.setattr(OutputPolicy, "_scan", checked)
    monkeypatch.setattr(output_policy, "_MARK_EVERY", 8)
    engine = make_tiny_engine()
    step = "Stir the sauce slowly over a low heat until it thickens"
    answer = json.dumps({"title": "A long recipe for a rainy autumn evening at home",
                         "steps": [step] * 6, "serves": 4,
                         "note": "Best eaten warm with fresh bread"})
    scripted(engine, answer)
    spec = GrammarSpec.json_schema(SCHEMA, engine=engine_name)
    # a budget under the answer: the closing window (where the reader is read every step)
    # holds the second cut, a loop of "!" in the note, past the reader's last copy
    budget = 90
    req = GenerationRequest([{"role": "user", "content": "A recipe, please."}],
                            SamplingParams(max_new_tokens=budget, temperature=0.0), grammar=spec)
    out = engine.generate([req])[req.request_id]
    assert out.validation == "valid", out.text
    assert out.loop_cuts >= 1, out.text  # the repeated step was cut
    assert seen and all(got == want for got, want in seen), [
        (got, want) for got, want in seen if got != want][:3]
    assert restored, "no reader was read on from a copy"
    print(f"{len(seen)} readers compared, read on from a copy {len(restored)} times")
