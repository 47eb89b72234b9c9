"""The guided path: everything a grammar or a thought changes about a request's output.
It imports nothing of the engine (rows.py declares what it needs of a row;
tests/unit/test_layers_unit.py holds it to that).

- The engine's handles: request.py (``GuidedPath`` per engine, ``GuidedRequest`` per
  request: the hooks the engine calls), guided_process.py (``GuidedDecodingManager``:
  grammars, matchers, masks), rows.py (the row and config protocols).
- Grammar backends: backend.py (the protocol and the ``auto`` rule), xgrammar_backend.py,
  llguidance_backend.py; for llguidance's schemas, schema_rewrites.py, schema_options.py
  and schema_budget.py; compile_queue.py (a worker's own compiles, fair per client).
- Masks: bitmask.py (and kernels/, the CPU bitmask in C).
- How an output ends: output_policy.py (one object per request), closing.py (the shortest
  finish within the budget), search_slices.py (those searches, sliced off the batch's
  time), shortest_bound.py and schema_witness.py (what a schema's shortest answer is),
  loop_guard.py with loop_near.py and loop_periods.py (values that repeat, cut),
  jump_forward.py (forced text without a decode step), reasoning.py (a thought, then the
  answer), validation.py (the finished JSON against its full schema).
- The stream's text: detokenizer.py (incremental, with stop strings).
- Before any request: grammar_check.py and check_reports.py (``POST /v1/grammars``).
"""
